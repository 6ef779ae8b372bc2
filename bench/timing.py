"""One call at a time, timed: how bench.fp8_products, bench.shard and bench.attention_sweep time what they measure."""

from __future__ import annotations

import time

import torch


def call_seconds(fn, device: torch.device, iterations: int, warmup: int) -> list[float]:
    """Seconds of each of `iterations` calls of fn, after `warmup` untimed ones: on a GPU between two CUDA events
    recorded around the call (the second waited for), elsewhere by the wall clock."""
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(iterations):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - begin)
    return seconds
