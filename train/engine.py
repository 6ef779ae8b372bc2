"""From the Hydra config to a running DeepSpeed engine: device, process group, DeepSpeed's config.

A one-process CPU run and a 1,000-GPU run share this code: `resolve_device` reads train.device,
`init_distributed` joins the launcher's process group (or makes a one-process one),
`deepspeed_config` turns train.* / parallel.* / optim.* / deepspeed.* into DeepSpeed's JSON (with
train.precision's settings, train/precision.py), and
`create_engine` wraps this rank's model (parallel.build) with optimizer and LR schedule: a
DeepSpeedEngine (ZeRO 0–3, optional optimizer offload) or, for a pipeline, a PipelineEngine.
`counters` / `restore_counters` are the engine's checkpoint part: DeepSpeed's step counters, by name.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
from train.optimizer import ELSEWHERE, GIVEN_NORM, OWN_NORM
from train.precision import bf16_weights, deepspeed_settings, resolve_precision

from train.config.sections.train import DEVICES
# DeepSpeed's step counters a checkpoint keeps (the engine's attributes of these names, all ints)
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


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


def init_distributed(device: torch.device, timeout_s: float = 1800.0) -> None:
    """Join the launcher's process group (torchrun / deepspeed / srun), or make a one-process one.

    DeepSpeed picks gloo on CPU and nccl on CUDA; DS_ACCELERATOR is pinned so a CPU run on a
    GPU machine stays on the CPU. A collective that waits longer than `timeout_s`
    (train.collective_timeout_s) fails instead of waiting forever. A process that has joined one
    already (a benchmark building several engines) keeps it.
    """
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    if "RANK" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    import deepspeed

    _quiet_deepspeed()
    skip_shared_memory_op()
    _default_group_timeout(timedelta(seconds=timeout_s))
    if device.type == "cuda" and not dist.is_initialized():
        local = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(local)
        # Bound to its GPU from the start (NCCL otherwise guesses the device from the global rank);
        # DeepSpeed then adopts this group.
        dist.init_process_group("nccl", device_id=local, timeout=timedelta(seconds=timeout_s))
    deepspeed.init_distributed(verbose=False, timeout=timedelta(seconds=timeout_s))


def shutdown_distributed() -> None:
    """End a finished run's process group on every rank together: a barrier, then the group's
    teardown, so no rank exits while a peer's communication threads still talk to it (left to the
    interpreter's exit, gloo pipelines now and then aborted one rank after a run had finished)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _default_group_timeout(timeout: timedelta) -> None:
    """The timeout of the groups made later (tp, pp, dp: DeepSpeed's and ours), which torch's
    new_group takes from these module defaults, not from the world group: set once, at start."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout


def skip_shared_memory_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op, which gpt3d never calls.

    When its communication layer starts, DeepSpeed JIT-compiles `deepspeed_shm_comm` (C++, into
    the shared torch extension cache) for `inference_all_reduce`, an inference-only collective;
    training goes through torch.distributed. The build takes 40–70 s on 2 cores, and two
    environments sharing the cache (other compiler flags or include paths) rebuild it in turn at
    every launch. DeepSpeed builds only ops marked compatible in `deepspeed.ops.__compatible_ops__`,
    a table it keeps as one editable dict; marking this op incompatible skips the build.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(train, parallel, optim, extras: dict, dp_size: int, device: torch.device, plan=None) -> dict:
    """DeepSpeed's config from ours (the train, parallel and optim sections): batch geometry, ZeRO stage
    and offload, clipping, mixed precision, pipeline activation transfer, then the `deepspeed.*` extras
    (already checked: none of the keys gpt3d writes) on top. With the run's plan (train/plan/, on CUDA)
    ZeRO's buckets, overlap and prefetch are the plan's (train/plan/zero_buckets.py) instead of
    DeepSpeed's defaults; the precision's ZeRO stage wins."""
    config: dict = {}
    for path, value, _ in written(train, parallel, optim, dp_size, device, plan):
        _put(config, path, value)
    return _merge(config, extras)


def written(train, parallel, optim, dp_size: int, device: torch.device, plan=None) -> list[tuple[str, object, str | None]]:
    """(dotted DeepSpeed key, value, the gpt3d setting it comes from, or None for gpt3d's own defaults that
    the deepspeed group may change) for every key deepspeed_config writes."""
    precision = resolve_precision(train.precision, device)
    settings = deepspeed_settings(precision, int(parallel.zero_stage))
    zero_stage = settings.pop("zero_optimization")["stage"]
    entries = [
        ("train_batch_size", train.global_batch_size, "train.global_batch_size"),
        ("train_micro_batch_size_per_gpu", train.micro_batch_size, "train.micro_batch_size"),
        ("gradient_accumulation_steps", train.global_batch_size // (train.micro_batch_size * dp_size),
         "train.global_batch_size / (train.micro_batch_size · dp)"),
        # who clips: see `clipping`
        ("gradient_clipping", float(optim.grad_clip) if clipping(train, parallel, device) == ELSEWHERE else 0.0,
         "optim.grad_clip"),
        ("zero_optimization.stage", zero_stage, "parallel.zero_stage"),
        *((f"zero_optimization.{key}", value, None) for key, value in _plan_buckets(plan).items()),
        ("steps_per_print", 2**31 - 1, None),
        ("wall_clock_breakdown", False, None),
        # DeepSpeed's throughput timer synchronizes the device at the start and end of every micro batch;
        # gpt3d times steps itself (train/metrics.py: Meter), reading the device once per logged step
        ("timers.throughput.enabled", False, None),
        ("zero_allow_untested_optimizer", True, None),
        # our AdamW (GPT-3 settings, exact one-process equivalence) also when its state is offloaded
        ("zero_force_ds_cpu_optimizer", False, None),
        # precision: torch autocast, or bf16 weights with fp32 masters; never fp16
        ("fp16.enabled", False, "train.precision"),
        *((path, value, "train.precision") for path, value in _flat(settings)),
    ]
    if parallel.offload_optimizer:
        entries.append(("zero_optimization.offload_optimizer", {"device": "cpu", "pin_memory": device.type == "cuda"},
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
    from train.config.sections import ParallelConfig, TrainConfig
    from train.config.sections.optim import OptimConfig

    owned = dict(CLIENT_OBJECTS)
    for precision in ("fp32", "autocast", "bf16"):
        for zero in (0, 1, 2, 3):
            for offload in ((False, True) if zero else (False,)):
                train = TrainConfig(precision=precision, device="cpu")
                parallel = ParallelConfig(zero_stage=zero, offload_optimizer=offload, pp=2 if zero < 2 else 1,
                                          sequence_parallel=zero < 2)
                for path, _, source in written(train, parallel, OptimConfig(), 1, torch.device("cpu")):
                    if source is not None:
                        owned[path] = source
    return owned


def _plan_buckets(plan) -> dict:
    if plan is None:
        return {}
    from train.plan.zero_buckets import zero_optimization

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


def clipping(train, parallel, device: torch.device) -> str:
    """Who clips the gradient (train/optimizer.py: ClippingAdamW), from the train and parallel sections:
      OWN_NORM         ZeRO stage 0 in fp32 or autocast: DeepSpeed runs no optimizer around ours, and its
                       own ZeRO-0 clipping neither reports the norm nor counts pipeline stages right
      GIVEN_NORM       bf16 at ZeRO stage ≤ 1: DeepSpeed's bf16 optimizer computes the norm and skips a
                       non-finite step; ours clips by that norm without reading it back
      ELSEWHERE        ZeRO stage ≥ 1 otherwise (train/precision.py): DeepSpeed's ZeRO optimizer clips"""
    precision = resolve_precision(train.precision, device)
    settings = deepspeed_settings(precision, int(parallel.zero_stage))
    if settings["zero_optimization"]["stage"] == 0:
        return OWN_NORM
    return GIVEN_NORM if bf16_weights(precision) and int(parallel.zero_stage) <= 1 else ELSEWHERE


def create_engine(model, optimizer, lr_scheduler, ds_config: dict, mpu=None):
    """deepspeed.initialize with our optimizer and scheduler; a PipelineModule gives a PipelineEngine.

    DeepSpeed's bf16 optimizer prints memory figures to stdout while it is set up, past its logger's
    level; they are left out of the run's output."""
    import contextlib
    import io

    import deepspeed

    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=ds_config, mpu=mpu
        )
    return engine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


def counters(engine) -> dict:
    """The engine's checkpoint entries: {"engine": {counter: value}} for each of ENGINE_COUNTERS it has."""
    return {"engine": {key: int(getattr(engine, key)) for key in ENGINE_COUNTERS if hasattr(engine, key)}}


def restore_counters(engine, state: dict) -> None:
    """Set the saved counters back (only ENGINE_COUNTERS: the checkpoint's verification refuses others)."""
    for key in ENGINE_COUNTERS:
        if key in state["engine"]:
            setattr(engine, key, int(state["engine"][key]))
