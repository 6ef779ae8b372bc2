"""GPU sweep of the attention kernels' block configurations: every configuration in SWEEP
(model/attention_configs.py, the space the sm_90 compile keeps) timed alone, so that the next TABLE
is chosen from measurements on the CPU.

  python -m bench.attention_sweep --json out.json   # on a GPU: every case until the deadline (270 s)
  python -m bench.attention_sweep --list            # the cases in the order they are timed, on any machine
  python -m bench.attention_sweep --smoke           # the sweep's code on the CPU under TRITON_INTERPRET=1,
                                                    # two configurations per kernel at a toy size

A case is one kernel ("forward"; "backward", the default backward's key-block kernel with atomic dQ
adds; "backward_kv" and "backward_dq", the deterministic backward's two passes), one configuration,
one head dim and one shape: q, k, v as slices of one (B, T, H, 3, D) projection as the model makes
them, bf16, B=8, H=16, T=2048 causal first (the headline), then the same with a 256-token window
(GPT-3's banded layers), then T=512 causal (the short bucket). The kernel under test runs the case's
configuration and every other kernel its TABLE entry; the time is that of the call that launches it
(flash_forward for the forward, flash_backward for the others: the cheap preprocess and dQ copy are
the same in every configuration of a kernel), the median of 10 timed calls after one untimed one.

Compiling dominates a sweep: before any timing, --compile-workers processes (default: one per CPU
but one) each run their share of the cases once at T=256, which compiles the same binaries (T, lo,
hi are not specialised) into Triton's on-disk cache, where the timing process finds them; they stop
at half the deadline, and whatever is left compiles when it is timed.

Every record is written as soon as it is measured (a killed sweep keeps what it timed): kernel,
config {BLOCK_M, BLOCK_N, mask, num_warps, num_stages}, in_table (whether TABLE chose it there),
head_dim, batch, heads, T, causal, window, dtype, ms, tflops (in-band pairs only: forward 4·B·H·D
per visible pair, the backwards 2.5× that, five products, the deterministic one counted the same),
error (a configuration that failed to compile or run), device, commit, date, command.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_ORDER = ("forward", "backward", "backward_kv", "backward_dq")
HEAD_DIM_ORDER = (128, 64, 80, 96)  # GPT-3 175B/13B/6.7B/1.3B, 125M/350M, 2.7B, 760M
SHAPES = ((2048, None), (2048, 256), (512, None))  # (T, window), causal, in the order they are timed
BATCH, HEADS = 8, 16
WARM_T = 256


def cases(shapes=SHAPES, head_dims=HEAD_DIM_ORDER, per_kernel=None) -> list[dict]:
    """Every case in timing order, TABLE's choice first among a kernel's; per_kernel: at most that many
    configurations per kernel, head dim and shape."""
    from model.attention_configs import chosen, sweep_at

    out = []
    for t, window in shapes:
        for d in head_dims:
            for kernel in KERNEL_ORDER:
                table = chosen(kernel, d, _bucket(t))
                entries = sorted(sweep_at(kernel, d), key=lambda entry: entry != table)[:per_kernel]  # TABLE's first
                out += [{"kernel": kernel, "entry": list(entry), "head_dim": d, "T": t, "window": window,
                         "in_table": entry == table} for entry in entries]
    return out


def _bucket(t: int) -> int:
    return 1 << (t - 1).bit_length()


def pairs(t: int, window: int | None) -> int:
    """Visible (query, key) pairs of causal attention, banded to `window` keys when given."""
    return sum(i + 1 if window is None else min(i + 1, window) for i in range(t))


class Forced:
    """Within it, each attention kernel runs one configuration: the case's kernel the case's, every
    other kernel its TABLE entry for the case's head dim and T bucket."""

    def __init__(self, case):
        from model import attention_triton as at
        from model.attention_configs import KERNELS, chosen

        self.tuners = at.autotuners()
        self.kept = {name: tuner.configs for name, tuner in self.tuners.items()}
        self.configs = {}
        for name in self.tuners:
            entry = tuple(case["entry"]) if name == case["kernel"] else chosen(name, case["head_dim"],
                                                                               _bucket(case["T"]))
            self.configs[name] = at.triton_configs([entry], KERNELS[name][1])

    def __enter__(self):
        for name, tuner in self.tuners.items():
            tuner.configs = self.configs[name]  # one candidate: the autotuner runs it, benchmarking nothing

    def __exit__(self, *exc):
        for name, tuner in self.tuners.items():
            tuner.configs = self.kept[name]


def make_call(case, t, device, dtype):
    """call() that launches the case's kernel once, on fresh packed-QKV inputs of T=t."""
    import torch

    from model import attention_triton as at
    from model.attention import band_limits

    d = case["head_dim"]
    batch = BATCH if device.type == "cuda" else 1
    heads = HEADS if device.type == "cuda" else 2
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(batch, t, heads, 3, d, generator=gen, device=device, dtype=dtype)  # (B, T, H, 3, D)
    lo, hi = band_limits(t, True, case["window"])
    tensors = (qkv,)
    if case["kernel"] == "forward":
        return lambda: at.flash_forward(tensors, lo, hi)
    with Forced(case):
        o, lse = at.flash_forward(tensors, lo, hi)  # (B, H, T, D), (B, H, T)
    do = torch.randn(o.shape, generator=gen, device=device, dtype=dtype)  # (B, H, T, D)
    deterministic = case["kernel"] != "backward"
    return lambda: at.flash_backward(tensors, o, lse, do, lo, hi, deterministic)


def warm(chunk, dtype_name, stop_at):
    """In a fresh process: run each case once at T=WARM_T, compiling its kernels into Triton's cache,
    until the wall clock passes stop_at (time.time()); returns how many cases it compiled."""
    import torch

    device = torch.device("cuda")
    dtype = getattr(torch, dtype_name)
    done = 0
    for case in chunk:
        if time.time() > stop_at:
            break
        try:
            with Forced(case):
                make_call(case, WARM_T, device, dtype)()
            done += 1
        except Exception:  # the timing process records the error of this case
            pass
    torch.cuda.synchronize()
    return done


def timed(case, device, dtype, reps):
    """(ms, error): the median of `reps` timed calls after one untimed one."""
    from bench.timing import call_seconds

    try:
        with Forced(case):
            seconds = call_seconds(make_call(case, case["T"], device, dtype), device, reps, warmup=1)
    except Exception as err:  # a configuration that does not compile or run: recorded, the sweep goes on
        return None, f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
    return 1e3 * statistics.median(seconds), None


def record(case, ms, error, device_name, batch, heads, dtype_name, stamp) -> dict:
    flops = 4.0 * batch * heads * case["head_dim"] * pairs(case["T"], case["window"])
    if case["kernel"] != "forward":
        flops *= 2.5
    keys = ("BLOCK_M", "BLOCK_N", "mask", "num_warps", "num_stages")
    return {"kernel": case["kernel"], "config": dict(zip(keys, case["entry"])), "in_table": case["in_table"],
            "head_dim": case["head_dim"], "batch": batch, "heads": heads, "T": case["T"], "causal": True,
            "window": case["window"], "dtype": dtype_name, "ms": ms,
            "tflops": flops / ms / 1e9 if ms else None, "error": error, **stamp}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", type=Path, help="write every record to PATH as a JSON list")
    parser.add_argument("--list", action="store_true", help="print the cases in timing order, time nothing")
    parser.add_argument("--smoke", action="store_true",
                        help="on the CPU under TRITON_INTERPRET=1: two configurations per kernel, T=64, d=64")
    parser.add_argument("--seconds", type=float, default=270.0, help="deadline: no case starts after it")
    parser.add_argument("--compile-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="processes compiling the cases before the timing (0: compile while timing)")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, as triton.jit reads it
    sys.path.insert(0, str(REPO))
    if args.list:
        for case in cases():
            print(json.dumps({k: case[k] for k in ("kernel", "entry", "head_dim", "T", "window", "in_table")}))
        return
    import torch

    from bench.attention import git_commit

    if args.smoke:
        device, dtype_name = torch.device("cpu"), "float16"
        todo = cases(shapes=((64, None),), head_dims=(64,), per_kernel=2)
        batch, heads, reps = 1, 2, 1
    elif torch.cuda.is_available():
        device, dtype_name = torch.device("cuda"), "bfloat16"
        todo, batch, heads, reps = cases(), BATCH, HEADS, 10
    else:
        raise SystemExit("attention_sweep: no CUDA device (use --smoke or --list on a CPU)")
    deadline = time.monotonic() + args.seconds
    dtype = getattr(torch, dtype_name)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    stamp = {"device": device_name, "commit": git_commit(),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "command": " ".join(["python -m bench.attention_sweep", *sys.argv[1:]])}
    if device.type == "cuda" and args.compile_workers:
        # one representative per (kernel, configuration, head dim): T and the band are not specialised
        unique = list({(c["kernel"], tuple(c["entry"]), c["head_dim"]): c for c in todo}.values())
        chunks = [unique[i::args.compile_workers] for i in range(args.compile_workers)]
        start = time.monotonic()
        stop_at = time.time() + args.seconds / 2  # at most half the time compiling ahead; the rest compiles on demand
        with concurrent.futures.ProcessPoolExecutor(args.compile_workers,
                                                    mp_context=multiprocessing.get_context("spawn")) as pool:
            warmed = sum(pool.map(warm, chunks, [dtype_name] * len(chunks), [stop_at] * len(chunks)))
        print(f"compiled {warmed} of {len(unique)} (kernel, configuration, head dim) in "
              f"{time.monotonic() - start:.0f} s with {args.compile_workers} processes", flush=True)
    records = []
    print(f"{'kernel':<12} {'config (M, N, mask, warps, stages)':<34} {'d':>4} {'T':>5} {'window':>6} "
          f"{'ms':>8} {'TFLOP/s':>8}  table")
    for case in todo:
        if time.monotonic() > deadline:
            print(f"deadline: {len(todo) - len(records)} of {len(todo)} cases not timed", flush=True)
            break
        ms, error = timed(case, device, dtype, reps)
        records.append(record(case, ms, error, device_name, batch, heads, dtype_name, stamp))
        r = records[-1]
        figures = f"{ms:>8.3f} {r['tflops']:>8.1f}" if ms else f"FAILED {error}"
        print(f"{case['kernel']:<12} {str(tuple(case['entry'])):<34} {case['head_dim']:>4} {case['T']:>5} "
              f"{str(case['window']):>6} {figures}  {'*' if case['in_table'] else ''}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
