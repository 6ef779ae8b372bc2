"""DeepSpeed's config from the run's sections, and the engine around this rank's model.

`deepspeed_config` turns train.* / parallel.* / optim.* / deepspeed.* into DeepSpeed's JSON (with the
resolved precision's settings, train/runtime/precision.py), `clipping` says who clips the gradient,
and `create_engine` wraps this rank's model (parallel.build) with optimizer and LR schedule: a
DeepSpeedEngine (ZeRO 0–3, optional optimizer offload) or, for a pipeline, a PipelineEngine; at one
data-parallel rank it turns off the engine's gradient all-reduce, which has no peer there. The device
and the process group are the runtime's (train/runtime/); DeepSpeed's step counters are a checkpoint
part (train/checkpoint/parts.py).
"""

from __future__ import annotations

import logging

import torch

from train.config.sections import OptimConfig, ParallelConfig, TrainConfig
from train.run.optimizer import ELSEWHERE, GIVEN_NORM, OWN_NORM
from train.runtime.precision import bf16_weights, deepspeed_settings
from train.runtime.resolve import Runtime


def deepspeed_config(train: TrainConfig, parallel: ParallelConfig, optim: OptimConfig, extras: dict, dp_size: int,
                     runtime: Runtime, plan=None) -> dict:
    """DeepSpeed's config from ours (the train, parallel and optim sections, and the runtime's precision):
    batch geometry, ZeRO stage and offload, clipping, mixed precision, pipeline activation transfer, then
    the `deepspeed.*` extras
    (already checked: none of the keys gpt3d writes) on top. With the run's plan (train/planner/, on CUDA)
    ZeRO's buckets, overlap and prefetch are the plan's (train/planner/zero_buckets.py) instead of
    DeepSpeed's defaults; the precision's ZeRO stage wins."""
    config: dict = {}
    for path, value, _ in written(train, parallel, optim, dp_size, runtime, plan):
        _put(config, path, value)
    return _merge(config, extras)


def written(train: TrainConfig, parallel: ParallelConfig, optim: OptimConfig, dp_size: int, runtime: Runtime,
            plan=None) -> list[tuple[str, object, str | None]]:
    """(dotted DeepSpeed key, value, the gpt3d setting it comes from, or None for gpt3d's own defaults that
    the deepspeed group may change) for every key deepspeed_config writes."""
    settings = deepspeed_settings(runtime.precision, int(parallel.zero_stage))
    zero_stage = settings.pop("zero_optimization")["stage"]
    entries = [
        ("train_batch_size", train.global_batch_size, "train.global_batch_size"),
        ("train_micro_batch_size_per_gpu", train.micro_batch_size, "train.micro_batch_size"),
        ("gradient_accumulation_steps", train.global_batch_size // (train.micro_batch_size * dp_size),
         "train.global_batch_size / (train.micro_batch_size · dp)"),
        # who clips: see `clipping`
        ("gradient_clipping", float(optim.grad_clip) if clipping(parallel, runtime) == ELSEWHERE else 0.0,
         "optim.grad_clip"),
        ("zero_optimization.stage", zero_stage, "parallel.zero_stage"),
        *((f"zero_optimization.{key}", value, None) for key, value in _plan_buckets(plan).items()),
        ("steps_per_print", 2**31 - 1, None),
        ("wall_clock_breakdown", False, None),
        # DeepSpeed's throughput timer synchronizes the device at the start and end of every micro batch;
        # gpt3d times steps itself (train/monitor/metrics.py: Meter), reading the device once per logged step
        ("timers.throughput.enabled", False, None),
        ("zero_allow_untested_optimizer", True, None),
        # our AdamW (GPT-3 settings, exact one-process equivalence) also when its state is offloaded
        ("zero_force_ds_cpu_optimizer", False, None),
        # precision: torch autocast, or bf16 weights with fp32 masters; never fp16
        ("fp16.enabled", False, "train.precision"),
        *((path, value, "train.precision") for path, value in _flat(settings)),
    ]
    if bf16_weights(runtime.precision) and int(parallel.zero_stage) <= 1:
        # DeepSpeed's bf16 optimizer adds each bf16 gradient to its fp32 one as backward makes it, and drops the
        # bf16 one (none is kept, accumulated or zeroed); the W pass of zb-h1 and zb-v adds its own (parallel/schedules/engine.py)
        entries.append(("bf16.immediate_grad_update", parallel.pp == 1, "train.precision"))
    if parallel.offload_optimizer:
        entries.append(("zero_optimization.offload_optimizer", {"device": "cpu", "pin_memory": runtime.device.type == "cuda"},
                        "parallel.offload_optimizer"))
    if parallel.sequence_parallel and parallel.pp > 1:
        # The pipeline engine would send each stage's output cut into tp pieces and gather them on the
        # next stage, which assumes every tp rank holds the same activations. Under sequence
        # parallelism each holds its own part of the sequence, so each sends its part whole.
        entries += [(f"pipeline.{key}", False, "parallel.sequence_parallel") for key in ("pipe_partitioned", "grad_partitioned")]
    return entries


# Passed to deepspeed.initialize as objects (create_engine), so never in its config
CLIENT_OBJECTS = {"optimizer": "optim.*", "scheduler": "optim.*"}


def owned_deepspeed_keys() -> dict[str, str]:
    """{dotted DeepSpeed key: the gpt3d setting it comes from} for every key `written` derives from a gpt3d
    setting under any precision, ZeRO stage, offload and pipeline, plus the client objects: what the
    deepspeed group may not set."""
    owned = dict(CLIENT_OBJECTS)
    for precision in ("fp32", "autocast", "bf16"):
        for zero in (0, 1, 2, 3):
            for offload in ((False, True) if zero else (False,)):
                parallel = ParallelConfig(zero_stage=zero, offload_optimizer=offload, pp=2 if zero < 2 else 1,
                                          sequence_parallel=zero < 2)
                for path, _, source in written(TrainConfig(), parallel, OptimConfig(), 1, Runtime(torch.device("cpu"), precision)):
                    if source is not None:
                        owned[path] = source
    return owned


def _plan_buckets(plan) -> dict:
    if plan is None:
        return {}
    from train.planner.zero_buckets import zero_optimization

    return {key: value for key, value in zero_optimization(plan).items() if key != "stage"}


def _flat(settings: dict, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, value) of every leaf of a nested dict."""
    out = []
    for key, value in settings.items():
        path = f"{prefix}{key}"
        out += _flat(value, f"{path}.") if isinstance(value, dict) else [(path, value)]
    return out


def _put(config: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for name in parents:
        config = config.setdefault(name, {})
    config[leaf] = value


def _merge(base: dict, extra: dict) -> dict:
    """base with extra's keys laid over it, recursively."""
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def clipping(parallel: ParallelConfig, runtime: Runtime) -> str:
    """Who clips the gradient (train/run/optimizer.py: ClippingAdamW), from the ZeRO stage and the precision:
      OWN_NORM         ZeRO stage 0 in fp32 or autocast: DeepSpeed runs no optimizer around ours, and its
                       own ZeRO-0 clipping neither reports the norm nor counts pipeline stages right
      GIVEN_NORM       bf16 at ZeRO stage ≤ 1: DeepSpeed's bf16 optimizer computes the norm and ours clips by it
                       and skips a non-finite step, all on the device (train/run/bf16_optimizer.py); with the
                       optimizer offloaded DeepSpeed's ZeRO-1 optimizer computes it and skips on the host
      ELSEWHERE        ZeRO stage ≥ 1 otherwise (train/runtime/precision.py): DeepSpeed's ZeRO optimizer clips"""
    settings = deepspeed_settings(runtime.precision, int(parallel.zero_stage))
    if settings["zero_optimization"]["stage"] == 0:
        return OWN_NORM
    return GIVEN_NORM if bf16_weights(runtime.precision) and int(parallel.zero_stage) <= 1 else ELSEWHERE


def take_norm(optimizer, engine) -> bool:
    """Our optimizer (train/run/optimizer.py, clipping GIVEN_NORM) takes ‖g‖ from the one DeepSpeed wraps it in:
    DeepSpeed's bf16 optimizer, made to step on the device (train/run/bf16_optimizer.py), or its ZeRO-1 optimizer
    (offloaded). Returns whether the step's skip is then decided on the device."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from train.run import bf16_optimizer

    holder, on_device = engine.optimizer, False
    if isinstance(holder, BF16_Optimizer):
        holder, on_device = bf16_optimizer.adopt(holder), True
    optimizer.take_norm_from(holder)
    return on_device


def create_engine(model, optimizer, lr_scheduler, ds_config: dict, mpu=None):
    """deepspeed.initialize with our optimizer and scheduler; a PipelineModule gives a PipelineEngine.

    DeepSpeed's bf16 optimizer prints memory figures to stdout while it is set up, past its logger's
    level; they are left out of the run's output, as is the warning that ZeRO runs an optimizer DeepSpeed
    has not tested (ours, allowed by zero_allow_untested_optimizer: gpt3d's own tests cover it)."""
    import contextlib
    import io

    import deepspeed
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.utils import logger

    if not any(isinstance(f, _OurOptimizerIsTested) for f in logger.filters):
        logger.addFilter(_OurOptimizerIsTested())
    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=ds_config, mpu=mpu
        )
    zero_partitions = isinstance(engine.optimizer, ZeROOptimizer) and not isinstance(engine.optimizer, BF16_Optimizer)
    if engine.dp_world_size == 1 and not zero_partitions:
        # no peer to all-reduce the gradients with: no flatten, copy and all-reduce (DeepSpeed's ZeRO optimizers
        # move their gradients into partitions in that call, so theirs stays)
        engine.enable_backward_allreduce = False
    return engine


class _OurOptimizerIsTested(logging.Filter):
    """Drops DeepSpeed's warning "You are using ZeRO with an untested optimizer" (see create_engine)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()
