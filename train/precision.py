"""train.precision: in which number formats a run computes, and who holds the fp32 state.

  fp32      weights, activations and gradients in fp32 (CPU default: the layout tests are exact there)
  autocast  fp32 weights; forward and backward under torch's bf16 autocast, which casts every weight
            to bf16 on every micro batch and keeps the casts for backward (kept for comparison)
  bf16      the module's weights are bf16 and so is all compute; DeepSpeed's bf16 optimizer holds the
            fp32 master weights, an fp32 gradient accumulation buffer and runs our AdamW on the
            masters, so the fp32 moments are the masters' too. After each update the masters are
            rounded into the bf16 weights once (no cast per micro batch)
  fp8       refused, with the reason for this device: float8 matmuls need compute capability ≥ 9.0
            (Hopper), and gpt3d's linear layers are tensor-parallel modules that torchao's float8
            training (which swaps nn.Linear) does not convert yet
  auto      bf16 on CUDA, fp32 on CPU

Under bf16 DeepSpeed's bf16 optimizer (deepspeed/runtime/bf16_optimizer.py) does what ClippingAdamW
does at ZeRO-0: it sums the gradient's square norm over the model-parallel group (each tensor-parallel
shard once, the pipeline-tied matrix once), clips g ← g · min(1, c / (‖g‖ + 1e-6)), and skips the
update (no weight, moment or step-count change, `overflow` set) when ‖g‖ is not finite. It is
DeepSpeed's ZeRO-1 optimizer for bf16, so at parallel.zero_stage 0 and 1 alike DeepSpeed runs it at
stage 1: the fp32 masters and moments are split over the data-parallel ranks (at dp=1 nothing is
split). At zero_stage 2 and 3 DeepSpeed's ZeRO optimizer keeps the fp32 partitions itself.

Checkpoints read the fp32 masters and moments through DeepSpeed's `safe_get_full_*` in every case
(train/checkpoint/optimizer_state.py), so a bf16 checkpoint is the same fp32 checkpoint any other
precision or layout writes and reads.

Bytes per parameter held under bf16 (ZeRO stage ≤ 1, per data-parallel replica, before partitioning):
bf16 weights 2 + bf16 gradients 2 + fp32 gradient accumulation buffer 4 + fp32 masters 4 + fp32
moments 8 = 20; the masters and moments (12) are split over dp. fp32 and autocast hold 16 (weights 4,
gradients 4, moments 8).
"""

from __future__ import annotations

import torch

from train.config.sections.train import PRECISIONS

FP8_MIN_CAPABILITY = (9, 0)  # float8 tensor cores: Hopper (sm_90) and newer


def resolve_precision(requested: str, device: torch.device) -> str:
    """train.precision with auto resolved: bf16 on CUDA, fp32 elsewhere."""
    if requested not in PRECISIONS:
        raise ValueError(f"train.precision={requested!r}: must be one of {list(PRECISIONS)}")
    if requested == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return requested


def bf16_weights(precision: str) -> bool:
    """The module's weights are bf16 with fp32 masters in the optimizer."""
    return precision == "bf16"


def deepspeed_settings(precision: str, zero_stage: int) -> dict:
    """DeepSpeed's precision settings and the ZeRO stage DeepSpeed runs (see the module docstring)."""
    if precision == "autocast":
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "zero_optimization": {"stage": zero_stage}}
    if not bf16_weights(precision):
        return {"zero_optimization": {"stage": zero_stage}}
    settings = {"bf16": {"enabled": True}, "zero_optimization": {"stage": max(zero_stage, 1)}}
    if zero_stage <= 1:  # DeepSpeed's bf16 optimizer, accumulating micro batches' gradients in fp32
        settings["data_types"] = {"grad_accum_dtype": "fp32"}
    return settings


def fp8_refusal(device: torch.device) -> str:
    """Why train.precision=fp8 cannot run on `device` (see the module docstring)."""
    if device.type != "cuda":
        return (f"train.precision=fp8 needs a CUDA GPU of compute capability ≥ "
                f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} (Hopper or newer); this run is on {device.type}. "
                f"Use train.precision=bf16 (or auto)")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return (f"train.precision=fp8 needs compute capability ≥ {'.'.join(map(str, FP8_MIN_CAPABILITY))} "
                f"(Hopper or newer); {torch.cuda.get_device_name(device)} has {'.'.join(map(str, capability))}. "
                f"Use train.precision=bf16")
    return ("train.precision=fp8: float8 training of gpt3d's linear layers is not available yet (they are "
            "tensor-parallel modules, parallel/tensor.py, which torchao's float8 conversion of nn.Linear does not "
            "reach); use train.precision=bf16")
