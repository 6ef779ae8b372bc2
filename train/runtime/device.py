"""train.device on this machine, and how CUDA is set up for it before it initialises.

`resolve_device` turns the setting into a torch.device (auto: a GPU when one is visible);
`order_cuda_queues` sets the one CUDA environment variable gpt3d needs, before anything touches CUDA.
"""

from __future__ import annotations

import os

import torch

from train.config.sections.train import DEVICES


def resolve_device(requested: str) -> torch.device:
    """train.device: auto → cuda if available else cpu."""
    if requested not in DEVICES:
        raise ValueError(f"train.device={requested!r}: must be one of {list(DEVICES)}")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    return torch.device(requested)


def order_cuda_queues(tp: int, layout: str, overlap: bool, device_setting: str) -> bool:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (unless already set) when tensor parallelism overlaps on a GPU: True if set.

    A column-parallel layer issues its input gradient's all-reduce, then the weight-gradient GEMM it
    overlaps (parallel/comm.py: overlapped_reduction). With one hardware queue from host to GPU the
    GPU starts kernels in the order they were issued, so the all-reduce gets its SMs before the GEMM
    takes them all, as Megatron-LM requires; with the default 8 queues the GEMM may start first and
    the all-reduce then waits behind it. The driver reads the variable when CUDA initialises, so this
    runs first thing in `python -m train`, before anything touches CUDA. Without tensor
    parallelism it is left alone: one queue would serialise ZeRO's communication streams behind the
    compute that they overlap. tp is not known yet under parallel.layout=auto; one queue is then set
    too, since the layouts it picks on GPUs use tensor parallelism."""
    wanted = overlap is True and device_setting != "cpu" and ((isinstance(tp, int) and tp > 1) or layout == "auto")
    if wanted:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return wanted
