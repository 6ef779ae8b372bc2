"""The DeepSpeed engine every run trains through, one process included.

A one-process CPU run and a 1,000-GPU run share this code: `init_distributed` fills in the
single-process rendezvous when no launcher did, `build_model` makes this rank's part of the
model for the layout (tensor-parallel GPT, or one pipeline stage), `deepspeed_config` turns the
Hydra config into DeepSpeed's JSON, and `create_engine` wraps model, optimizer and LR schedule:
a DeepSpeedEngine (ZeRO 0–3, optional optimizer offload) or, with pp > 1, a PipelineEngine.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
from omegaconf import OmegaConf

# Peak dense bf16 tensor-core FLOP/s by GPU name fragment (vendor data sheets, without sparsity); the
# first fragment found in the device name wins, so longer names come before their prefixes.
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
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


def build_model(model_cfg, cfg, topology, device: torch.device) -> torch.nn.Module:
    """This rank's model: a (tensor-parallel) GPT, or with pp > 1 its pipeline stage; initialised so
    that the full weights are the one-process model's for the same seed."""
    from model import GPT
    from parallel.pipeline import build_pipeline
    from parallel.tensor import shard

    if topology.pp_size > 1:
        return build_pipeline(
            model_cfg, topology, cfg.train.seed, device, checkpoint_every=cfg.parallel.activation_checkpointing
        )
    with torch.device("meta"):
        model = GPT(model_cfg)
    shard(model, topology, sequence_parallel=cfg.parallel.sequence_parallel)
    model.activation_checkpointing = cfg.parallel.activation_checkpointing
    return model.materialize(device, cfg.train.seed)


def deepspeed_config(cfg, dp_size: int, device: torch.device) -> dict:
    """DeepSpeed's config from ours: batch geometry, ZeRO stage and offload, clipping, mixed
    precision, then any `deepspeed.*` extras (already validated) on top."""
    train, parallel = cfg.train, cfg.parallel
    accumulation = train.global_batch_size // (train.micro_batch_size * dp_size)
    zero = {"stage": int(parallel.zero_stage)}
    if parallel.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    config = {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        # ZeRO ≥ 1: DeepSpeed's ZeRO optimizer clips. ZeRO-0: our ClippingAdamW does (train/optimizer.py),
        # since DeepSpeed's own ZeRO-0 clipping neither reports the norm nor counts pipeline stages right.
        "gradient_clipping": float(cfg.optim.grad_clip) if int(parallel.zero_stage) > 0 else 0.0,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # our AdamW (GPT-3 settings, exact one-process equivalence) also when its state is offloaded
        "zero_force_ds_cpu_optimizer": False,
    }
    if device.type == "cuda":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return _merge(config, OmegaConf.to_container(cfg.deepspeed, resolve=True) if "deepspeed" in cfg else {})


def _merge(base: dict, extra: dict) -> dict:
    """base with extra's keys laid over it, recursively."""
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def create_engine(model, optimizer, lr_scheduler, ds_config: dict, mpu=None):
    """deepspeed.initialize with our optimizer and scheduler; a PipelineModule gives a PipelineEngine."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=ds_config, mpu=mpu
    )
    return engine


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
