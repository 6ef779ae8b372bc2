"""The DeepSpeed engine every run trains through, one process included.

A one-process CPU run and a 1,000-GPU run share this code: `init_distributed` fills in the
single-process rendezvous when no launcher did, `deepspeed_config` turns the Hydra config into
DeepSpeed's JSON, and `create_engine` wraps model, optimizer and LR schedule.
"""

from __future__ import annotations

import logging
import os
import socket

import torch

# Peak dense bf16 tensor-core FLOP/s by GPU name fragment (vendor data sheets, without sparsity).
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
    "V100": 125.0,
}


def resolve_device(requested: str) -> torch.device:
    """train.device: auto → cuda if available else cpu."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"train.device={requested!r}: must be one of ['auto', 'cpu', 'cuda']")
    return torch.device(requested)


def init_distributed(device: torch.device) -> None:
    """Join the launcher's process group (torchrun / deepspeed), or make a one-process one.

    DeepSpeed picks gloo on CPU and nccl on CUDA; DS_ACCELERATOR is pinned so a CPU run on a
    GPU machine stays on the CPU.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    if "RANK" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    import deepspeed

    _quiet_deepspeed()
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(verbose=False)


def deepspeed_config(cfg, dp_size: int, device: torch.device) -> dict:
    """DeepSpeed's config from ours: batch geometry, ZeRO stage, clipping, mixed precision."""
    train, parallel = cfg.train, cfg.parallel
    accumulation = train.global_batch_size // (train.micro_batch_size * dp_size)
    config = {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        # At ZeRO-0 in fp32 DeepSpeed clips but discards the norm: clip_and_step does it instead.
        "gradient_clipping": float(cfg.optim.grad_clip) if engine_clips(cfg) else 0.0,
        "zero_optimization": {"stage": int(parallel.zero_stage)},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if device.type == "cuda":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return config


def engine_clips(cfg) -> bool:
    """Whether DeepSpeed's own optimizer wrapper clips and reports the norm (ZeRO ≥ 1)."""
    return int(cfg.parallel.zero_stage) > 0


def create_engine(model, optimizer, lr_scheduler, ds_config: dict, mpu=None):
    """deepspeed.initialize with our optimizer and scheduler; returns the engine."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=ds_config, mpu=mpu
    )
    return engine


def clip_and_step(engine, max_norm: float, engine_clips_itself: bool) -> float | None:
    """engine.step() after one micro batch; at the accumulation boundary returns the global grad norm.

    The norm is measured before clipping, over all ranks (model-parallel shards counted once).
    """
    norm = None
    if engine.is_gradient_accumulation_boundary() and not engine_clips_itself:
        from deepspeed.runtime.utils import clip_grad_norm_

        norm = float(clip_grad_norm_(engine.module.parameters(), max_norm, mpu=engine.mpu))
    boundary = engine.is_gradient_accumulation_boundary()
    engine.step()
    if boundary and engine_clips_itself:
        value = engine.get_global_grad_norm()
        norm = float(value) if value is not None else None
    return norm


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """Per-device peak for MFU: the configured value, else the GPU's from GPU_PEAK_TFLOPS."""
    if configured is not None:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, tflops in GPU_PEAK_TFLOPS.items():
        if fragment in name:
            return tflops
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
