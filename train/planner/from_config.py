"""The planner from a run's config sections: its model, layout and hardware, the plan, and pre-flight.

For `python -m train.plan` (train/plan.py), `plan_from_config(sections, plan_cfg, model_cfg)`
predicts the composed config's layout on plan.gpus GPUs of plan.hardware. For a training run,
`plan_for_run(train, parallel, model_cfg)` predicts the run's
own layout on the visible GPU (train/run/spec.py computes it once per run), and `preflight(plan)`
(called by that resolution when the device is CUDA) stops a run whose predicted peak memory exceeds the
device's before anything is built, with one message giving that peak and the three fastest layouts on
the same GPUs, global batch and model that fit (leaving the default headroom for the CUDA context), as
overrides to paste.
"""

from __future__ import annotations

import dataclasses
import os

from model import GPTConfig
from train.config.sections import ParallelConfig, PlanConfig, Sections, TrainConfig
from train.config.sections.parallel import ONE_F_ONE_B
from train.config.settings import ConfigError
from train.planner.estimate import Implementation, Layout, Plan, build_plan, for_precision
from train.planner.hardware import Hardware, for_cuda_device, preset
from train.planner.search import layout_problem, search

HEADROOM_GIB = 2.0  # what pre-flight's alternatives leave free (plan.reserved_gib's default)


def layout_from_config(train: TrainConfig, parallel: ParallelConfig, model_cfg: GPTConfig, gpus: int) -> Layout:
    """The run's layout on `gpus` GPUs, its parallel.pipeline_schedule with it (1f1b without a pipeline,
    where the schedule means nothing); ValueError naming the problem when the trainer would refuse it."""
    par, tr = parallel, train
    tp, pp = par.tp, par.pp
    for key, value in (("parallel.tp", tp), ("parallel.pp", pp), ("plan.gpus", gpus),
                       ("train.global_batch_size", tr.global_batch_size), ("train.micro_batch_size", tr.micro_batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r}: must be a positive integer")
    if gpus % (tp * pp):
        raise ValueError(f"plan.gpus={gpus} is not a multiple of tp·pp = {tp * pp} (parallel.tp={tp}, parallel.pp={pp})")
    selective = par.activation_checkpointing == "selective"
    layout = Layout(
        tp=tp, pp=pp, dp=gpus // (tp * pp), global_batch=tr.global_batch_size, micro_batch=tr.micro_batch_size,
        zero_stage=par.zero_stage, offload_optimizer=bool(par.offload_optimizer),
        sequence_parallel=bool(par.sequence_parallel), checkpoint_every=0 if selective else par.activation_checkpointing,
        selective_recompute=selective, schedule=par.pipeline_schedule if pp > 1 else ONE_F_ONE_B,
        virtual_stages=par.virtual_stages if pp > 1 else 1,
        stage_layers=tuple(par.stage_layers) if pp > 1 and par.stage_layers is not None else None,
    )
    problem = layout_problem(model_cfg, layout)
    if problem:
        raise ValueError(problem)
    return layout


def stage_split(parallel: ParallelConfig):
    """The pipeline's stages as the run builds them (parallel.pipeline.StageSplit): the schedule's placement of
    its virtual stages and parallel.stage_layers."""
    from parallel.pipeline import StageSplit
    from parallel.schedules.orders import placement_of

    schedule = parallel.pipeline_schedule if parallel.pp > 1 else ONE_F_ONE_B
    blocks = tuple(parallel.stage_layers) if parallel.pp > 1 and parallel.stage_layers is not None else None
    return StageSplit(placement_of(schedule, parallel.pp, parallel.virtual_stages), blocks)


# DeepSpeed's communication_data_type (the deepspeed group): the bytes of a gradient element it reduces in
COMMUNICATION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def implementation_from_config(train: TrainConfig, parallel: ParallelConfig, compiled: bool,
                               fp8_linears=None, deepspeed: dict | None = None) -> Implementation:
    """gpt3d's implementation under the run's train.precision (auto: what it is on a GPU, bf16; the
    planner always predicts for a GPU), train.fp8_recipe and train.fp8_linears (or `fp8_linears`, the names
    a run resolved: train/run/spec.py), parallel.overlap_communication, parallel.tp_comm_overlap and train.fused_loss,
    model.compile as the run takes it (`compiled`: train.runtime.precision.fp8_compile), and DeepSpeed's
    communication_data_type from the deepspeed group (`deepspeed`), which sets the gradients' reduction dtype."""
    precision = "bf16" if train.precision == "auto" else train.precision
    implementation = for_precision(precision, bool(parallel.overlap_communication), train.fused_loss, train.fp8_recipe,
                                   compiled, train.fp8_linears if fp8_linears is None else tuple(fp8_linears),
                                   bool(parallel.tp_comm_overlap))
    dtype = (deepspeed or {}).get("communication_data_type")
    if dtype is None:
        return implementation
    dtype = str(dtype).lower()  # as DeepSpeed reads it
    if dtype not in COMMUNICATION_BYTES:
        raise ValueError(f"deepspeed.communication_data_type={dtype!r}: must be one of {list(COMMUNICATION_BYTES)}")
    return dataclasses.replace(implementation, grad_reduce_bytes=COMMUNICATION_BYTES[dtype])


def hardware_from_config(plan_cfg: PlanConfig) -> Hardware:
    return preset(plan_cfg.hardware, dataclasses.asdict(plan_cfg.device))


def gpus_of(plan_cfg: PlanConfig, parallel: ParallelConfig) -> int:
    if plan_cfg.gpus is not None:
        return plan_cfg.gpus
    return int(os.environ.get("WORLD_SIZE", parallel.tp * parallel.pp))


def plan_from_config(sections: Sections, plan_cfg: PlanConfig, model_cfg: GPTConfig) -> Plan:
    """The prediction `python -m train.plan` prints for a composed config (training's plus `plan`)."""
    train, parallel = sections.train, sections.parallel
    layout = layout_from_config(train, parallel, model_cfg, gpus_of(plan_cfg, parallel))
    return build_plan(
        model_cfg, layout, hardware_from_config(plan_cfg),
        implementation=implementation_from_config(train, parallel, model_cfg.compile, deepspeed=sections.deepspeed),
        gpus_per_node=plan_cfg.gpus_per_node, reserved_gib=float(plan_cfg.reserved_gib), tokens=float(plan_cfg.tokens),
    )


def plan_for_run(train: TrainConfig, parallel: ParallelConfig, model_cfg: GPTConfig,
                 hardware: Hardware | None = None, fp8_linears=None, deepspeed: dict | None = None) -> Plan:
    """The prediction for a training run's own config: its layout on WORLD_SIZE GPUs of
    LOCAL_WORLD_SIZE per node, on the visible GPU (or `hardware`; without CUDA the h100-80g preset), with
    the block linears in float8 the run resolved (`fp8_linears`, under fp8), DeepSpeed's settings `deepspeed`.
    Plan.to_json() is what to log with the run; Plan.predicted_mfu is the step log's comparison."""
    if hardware is None:
        import torch

        local = int(os.environ.get("LOCAL_RANK", 0))
        hardware = for_cuda_device(local) if torch.cuda.is_available() else preset("h100-80g")
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(world, 8)))
    return build_plan(model_cfg, layout_from_config(train, parallel, model_cfg, world), hardware,
                      implementation=implementation_from_config(train, parallel, model_cfg.compile, fp8_linears,
                                                                deepspeed),
                      gpus_per_node=per_node)


def layout_overrides(layout: Layout) -> str:
    """The command-line overrides that select `layout` (its dp follows from the world size)."""
    return " ".join([
        f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.zero_stage={layout.zero_stage}",
        f"parallel.sequence_parallel={str(layout.sequence_parallel).lower()}",
        f"parallel.activation_checkpointing={'selective' if layout.selective_recompute else layout.checkpoint_every}",
        f"train.micro_batch_size={layout.micro_batch}", f"parallel.pipeline_schedule={layout.schedule}",
        *([f"parallel.virtual_stages={layout.virtual_stages}"] if layout.virtual_stages > 1 else []),
        *([f"parallel.stage_layers=[{','.join(map(str, layout.stage_layers))}]"] if layout.stage_layers else []),
    ])


def failure_message(plan: Plan, alternatives: list[Plan]) -> str:
    worst = max(plan.ranks, key=lambda r: r.peak_bytes)
    hw, lay = plan.hardware, plan.layout
    text = (
        f"predicted peak memory {plan.peak_memory_gib:.1f} GiB per GPU (pipeline stage {worst.stage}) exceeds the "
        f"{hw.memory_gib:.1f} GiB of {hw.name} for {plan.model.name} with {lay.describe()} "
        f"({lay.global_batch} sequences per step on {lay.gpus} GPU(s)); "
    )
    if not alternatives:
        return text + "no layout of these GPUs fits this model and global batch: add GPUs or lower train.global_batch_size"
    choices = [
        f"({i}) {layout_overrides(p.layout)}: {p.peak_memory_gib:.1f} GiB, {p.tokens_per_s:,.0f} tokens/s"
        for i, p in enumerate(alternatives, 1)
    ]
    return text + "layouts that fit, fastest first: " + "; ".join(choices)


def preflight(plan: Plan) -> None:
    """Raise ConfigError (see module docstring) when the run's predicted peak exceeds the device's memory."""
    if plan.peak_memory_gib <= plan.hardware.memory_gib:
        return
    alternatives = search(
        plan.model, plan.layout.gpus, plan.layout.global_batch, plan.hardware,
        gpus_per_node=plan.gpus_per_node, reserved_gib=HEADROOM_GIB, implementation=plan.implementation,
    )[:3]
    raise ConfigError(failure_message(plan, alternatives))

