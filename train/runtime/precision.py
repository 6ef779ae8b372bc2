"""train.precision: in which number formats a run computes, and who holds the fp32 state.

  fp32      weights, activations and gradients in fp32 (CPU default: the layout tests are exact there)
  autocast  fp32 weights; forward and backward under torch's bf16 autocast, which casts every weight
            to bf16 on every micro batch and keeps the casts for backward (kept for comparison)
  bf16      the module's weights are bf16 and so is all compute; DeepSpeed's bf16 optimizer holds the
            fp32 master weights, an fp32 gradient accumulation buffer and runs our AdamW on the
            masters, so the fp32 moments are the masters' too. After each update the masters are
            rounded into the bf16 weights once (no cast per micro batch)
  fp8       bf16 as above, and those of the blocks' four linears (attn.qkv, attn.proj, mlp.fc, mlp.proj)
            whose products are faster in float8 at their shapes (train.fp8_linears: by the rule of
            train/planner/fp8_rule.py, resolved once by the run specification) compute their forward,
            input-gradient and weight-gradient products in float8, dynamically
            scaled (model/float8.py), by the recipe train.fp8_recipe: tensorwise (one scale per tensor;
            activations and weights e4m3, gradients e5m2) or rowwise (one scale per row of each
            product's contraction, every operand e4m3, power-of-two scales), torchao's recipes of those
            names. Each amax is reduced over the tensor-parallel ranks that hold pieces of its tensor, so
            every layout quantizes as one process does. The LayerNorms, attention, softmax, embedding,
            unembedding (the tied head) and loss stay bf16/fp32.
            Masters, moments, checkpoints: as bf16, so an fp8 checkpoint resumes at bf16 and the other
            way round, at any layout. Runs on CUDA GPUs of compute capability ≥ 8.9 (Ada, Hopper and
            newer: float8 tensor cores, through torch._scaled_mm), refused on older ones in one line
            naming bf16; on the CPU the same casts and scales run, and the products of the float8
            operands are torchao's emulation of _scaled_mm (an fp32 product of their exact values:
            _scaled_mm's CPU kernel is about a thousand times slower). Needs torchao (the `fp8` extra).
            The blocks run compiled (model.compile) wherever that can work, so the casts fuse into the
            kernels beside the products (`fp8_compile`): eager, one float8 linear launches about 70
            kernels more than a bf16 one, which at 125M and 350M costs more than float8 gains
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

Bytes per parameter held under bf16 and fp8 (ZeRO stage ≤ 1, per data-parallel replica, before partitioning):
bf16 weights 2 + bf16 gradients 2 + fp32 gradient accumulation buffer 4 + fp32 masters 4 + fp32
moments 8 = 20; the masters and moments (12) are split over dp. fp32 and autocast hold 16 (weights 4,
gradients 4, moments 8).
"""

from __future__ import annotations

import torch

from model.modes import Float8
from train.config.sections.train import PRECISIONS, TrainConfig

FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm_89), Hopper (sm_90) and newer


def resolve_precision(requested: str, device: torch.device) -> str:
    """train.precision with auto resolved: bf16 on CUDA, fp32 elsewhere."""
    if requested not in PRECISIONS:
        raise ValueError(f"train.precision={requested!r}: must be one of {list(PRECISIONS)}")
    if requested == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return requested


def bf16_weights(precision: str) -> bool:
    """The module's weights are bf16 with fp32 masters in the optimizer (fp8 computes from bf16 weights)."""
    return precision in ("bf16", "fp8")


def fp8_mode(precision: str, recipe: str, device: torch.device) -> Float8 | None:
    """How the blocks' linears compute in float8 (parallel.build.BuildOptions.fp8) under train.precision=fp8,
    else None: train.fp8_recipe, with torch._scaled_mm on a GPU and its emulation on the CPU, where
    _scaled_mm's kernel is about a thousand times slower than an fp32 product (model.modes.Float8)."""
    return Float8(recipe, emulate=device.type != "cuda") if precision == "fp8" else None


def check_fp8(train: TrainConfig, device: torch.device) -> None:
    """Under train.precision=fp8 (which auto never means), a device that runs float8 products and torchao
    installed (train.fp8_recipe is checked by its setting). Raises ValueError, one line naming the key."""
    if train.precision != "fp8":
        return
    refusal = fp8_refusal(device)
    if refusal is not None:
        raise ValueError(refusal)


def fp8_refusal(device: torch.device) -> str | None:
    """Why train.precision=fp8 cannot run on `device`, in one line naming bf16; None when it can."""
    from importlib.util import find_spec

    if find_spec("torchao") is None:
        return ("train.precision=fp8: needs torchao for its float8 casts and products: pip install -e '.[fp8]'; "
                "or use train.precision=bf16")
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return (f"train.precision=fp8: must run on compute capability ≥ {'.'.join(map(str, FP8_MIN_CAPABILITY))} "
                f"(float8 tensor cores: Ada, Hopper or newer); {torch.cuda.get_device_name(device)} has "
                f"{'.'.join(map(str, capability))}: use train.precision=bf16")
    return None


def fp8_compile(precision: str, model_compile: bool, compile_set: bool,
                device: torch.device | None = None) -> tuple[bool, str]:
    """model.compile as a run takes it, and under fp8 the words saying how its blocks run.

    Under train.precision=fp8 the blocks compile unless that cannot work: model.compile=false given on
    the command line (`compile_set`), the CPU (whose float8 products are
    emulated: there is no speed to gain; model.compile=true still compiles there), or torch.compile
    failing its probe on the GPU (model/compile.py). `device` None: the planner's GPU, where it works.
    Other precisions: model.compile as given, and no words."""
    if precision != "fp8":
        return model_compile, ""
    if model_compile:
        return True, "blocks compiled (model.compile=true)"
    if compile_set:
        return False, "blocks eager: model.compile=false was given (compiled, the float8 casts fuse into their neighbours)"
    if device is not None and device.type != "cuda":
        return False, f"blocks eager: on {device.type} the float8 products are emulated (model.compile=true compiles them)"
    if device is not None:
        from model.compile import compile_unavailable

        reason = compile_unavailable(device)
        if reason is not None:
            return False, f"blocks eager: torch.compile is unavailable on {device} ({reason})"
    return True, "blocks compiled (fp8 compiles them where it can, so the float8 casts fuse into their neighbours)"


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
