"""A GPU's time for one kernel, and for a step's sequence of kernel launches and device→host reads.

The ceilings are the hardware preset's measured ones (train/planner/hardware.py): the matrix rate
peak·gemm_efficiency (measured on an 8192³ bf16 product), the memory bandwidth hbm·hbm_efficiency
(measured by a large device-to-device copy, bytes read + written), the multiprocessors a kernel's
tiles are spread over; the attention kernel's rate by head dim (ATTENTION_TFLOPS, measured by
bench.attention); and three latencies of PyTorch's eager path on a GPU node (below), set where the
step bill's predictions meet the committed measurements (docs/benchmarks.md, "The step bill").

One kernel's device time (`kernel_seconds`):
  gemm        M×K by K×N in 128×256 output tiles over the multiprocessors: tiles t = ⌈M/128⌉·⌈N/256⌉ run
              in ⌈t/SM⌉ waves, so a partial last wave idles some (wave efficiency t / (⌈t/SM⌉·SM)); each
              tile's K loop pays a pipeline fill worth GEMM_FILL_K of depth (K / (K + GEMM_FILL_K)); fewer
              tiles than multiprocessors split K (`shape_efficiency`);
              time = max(2MNK / (rate · wave · depth), bytes / bandwidth) + KERNEL_FLOOR_S, the rate
              scaled so an 8192³ product runs at the measured one. A dimension that is no multiple of 8
              takes cuBLAS's unaligned kernels, at a tenth of the rate.
  attention   FLOPs / the kernel's measured rate for its head dim and pass, + one floor per launch
  other       bytes / bandwidth + one floor per launch (elementwise, reductions, copies, multi-tensor)

A step (`step_seconds`): the host issues operators in order, paying HOST_OP_S for each one that launches
a kernel and HOST_VIEW_S for each that does not (a view, an allocation: Python and the dispatcher
still run); the device runs each kernel once it is issued and the previous one has finished; a
device→host read makes the host wait until the device has run everything issued before it, plus
READ_S; a late read (of a value an earlier step made, read one step late) waits only until the device has
run that earlier step. The step is the steady-state period of that pipeline: the same step issued three times in a
row, (end of the third − end of the first) / 2, so a step whose host runs ahead of its device (no
reads) is bounded by the device alone, and one with reads pays the device's idle time after each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from train.planner.hardware import Hardware

GEMM_TILE = (128, 256)  # output rows × columns of one cuBLAS tile on Hopper (bf16)
GEMM_FILL_K = 128  # depth of K each tile's pipeline fill costs
SPLIT_K_MIN = 512  # the shallowest share of K a split-K product gives one tile
UNALIGNED_RATE = 0.1  # share of the matrix rate cuBLAS keeps when a dimension is no multiple of 8
KERNEL_FLOOR_S = 4e-6  # a kernel's shortest time on the device (launch and drain)
HOST_OP_S = 9e-6  # the host's time to issue one operator that launches a kernel, eager PyTorch from Python
HOST_VIEW_S = 2e-6  # and one that launches none (a view, an allocation)
READ_S = 15e-6  # a device→host read's round trip once the device is idle
# The attention kernel's rate (TFLOP/s of its band's FLOPs) by head dim, forward and backward: measured by
# bench.attention on one H200 (bench/results/NVIDIA-H200-2026-11-27-attention.json, T=2048, causal, batch 8 ×
# 16 heads; backward = forward + backward's time less the forward's, at 2.5 times the forward's FLOPs). The H100
# has the same multiprocessors and clocks, and the kernel is bound by them.
ATTENTION_TFLOPS = {64: (240.0, 198.0), 80: (178.0, 100.0), 96: (208.0, 116.0), 128: (295.0, 165.0)}


@dataclass(frozen=True)
class Launch:
    """What the cost model needs of one operator (the step bill's Op carries these fields)."""

    kind: str  # gemm, attention, memory, multi_tensor, collective, loss, view, alloc, query, read, late read
    kernels: int
    bytes: float
    flops: float
    gemm: tuple[int, int, int] | None = None  # (M, N, K)
    head_dim: int | None = None  # attention
    backward: bool = False  # attention


def gemm_seconds(hw: Hardware, m: int, n: int, k: int, moved: float) -> float:
    """One M×K by K×N product moving `moved` bytes (see the module docstring)."""
    rate = hw.flops / shape_efficiency(hw, 8192, 8192, 8192)
    if k % 8 or n % 8:
        rate *= UNALIGNED_RATE
    return max(2.0 * m * n * k / (rate * shape_efficiency(hw, m, n, k)), moved / hw.memory_bandwidth) + KERNEL_FLOOR_S


def shape_efficiency(hw: Hardware, m: int, n: int, k: int) -> float:
    """The share of the matrix rate an M×K by K×N product keeps: its tiles' last wave and each tile's pipeline
    fill. Too few tiles to fill the multiprocessors split K among them (cuBLAS's split-K), each split at
    least SPLIT_K_MIN deep."""
    tiles = math.ceil(m / GEMM_TILE[0]) * math.ceil(n / GEMM_TILE[1])
    split = max(1, min(hw.multiprocessors // tiles, k // SPLIT_K_MIN))
    tiles, depth = tiles * split, k / split
    waves = math.ceil(tiles / hw.multiprocessors)
    return tiles / (waves * hw.multiprocessors) * depth / (depth + GEMM_FILL_K)


def attention_seconds(head_dim: int, flops: float, backward: bool) -> float:
    """The fused attention kernel's FLOPs at its measured rate (the nearest head dim measured at or above)."""
    dims = sorted(ATTENTION_TFLOPS)
    dim = next((d for d in dims if d >= head_dim), dims[-1])
    return flops / (ATTENTION_TFLOPS[dim][1 if backward else 0] * 1e12)


def kernel_seconds(hw: Hardware, launch: Launch) -> float:
    """The device time of one operator's kernels (0 for an operator that launches none)."""
    if launch.kernels == 0:
        return 0.0
    if launch.kind == "gemm" and launch.gemm is not None:
        return gemm_seconds(hw, *launch.gemm, launch.bytes)
    floor = launch.kernels * KERNEL_FLOOR_S
    if launch.kind == "attention" and launch.head_dim is not None:
        return max(attention_seconds(launch.head_dim, launch.flops, launch.backward),
                   launch.bytes / hw.memory_bandwidth) + floor
    return launch.bytes / hw.memory_bandwidth + floor


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time and where the device spent it."""

    seconds: float  # the steady-state step
    device_busy: float  # seconds the device runs kernels in one step
    host: float  # seconds the host spends issuing one step's operators (reads' waits not counted)

    @property
    def device_idle(self) -> float:
        return max(self.seconds - self.device_busy, 0.0)


def step_seconds(hw: Hardware, launches: list[Launch]) -> StepTime:
    """The steady-state time of a step that issues `launches` in order (see the module docstring)."""
    costs = [kernel_seconds(hw, launch) for launch in launches]
    host = device = previous = 0.0  # previous: the device's time at the end of the step before
    ends = []
    for _ in range(3):
        for launch, cost in zip(launches, costs):
            if launch.kind == "query":
                continue
            if launch.kind == "read":
                host = max(host, device) + READ_S
            elif launch.kind == "late read":
                host = max(host, previous) + READ_S
            elif launch.kernels == 0:
                host += HOST_VIEW_S
            else:
                host += HOST_OP_S
                device = max(device, host) + cost
        ends.append(max(host, device))
        previous = device
    busy = sum(costs)
    issuing = sum(HOST_OP_S if launch.kernels else HOST_VIEW_S for launch in launches
                  if launch.kind not in ("read", "late read", "query"))
    return StepTime((ends[2] - ends[0]) / 2, busy, issuing)
