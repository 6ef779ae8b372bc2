"""The planner from a run's Hydra config: its model, layout and hardware, the plan, and pre-flight.

For `python -m train.plan` (cli.py), `plan_from_config(cfg)` predicts the composed config's layout on
plan.gpus GPUs of plan.hardware. For a training run, `plan_for_run(cfg, model_cfg)` predicts the run's
own layout on the visible GPU (train/config/spec.py computes it once per run), and `preflight(plan)`
(called by that resolution when the device is CUDA) stops a run whose predicted peak memory exceeds the
device's before anything is built, with one message giving that peak and the three fastest layouts on
the same GPUs, global batch and model that fit (leaving the default headroom for the CUDA context), as
overrides to paste.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from model import GPTConfig
from train.plan.hardware import Hardware, for_cuda_device, preset
from train.plan.estimate import Implementation, Layout, Plan, build_plan, for_precision
from train.config.checks import ConfigError
from train.plan.search import layout_problem, search

FORMATS = ("table", "json")
HEADROOM_GIB = 2.0  # what pre-flight's alternatives leave free (configs/plan/default.yaml: reserved_gib)


def model_config(cfg) -> GPTConfig:
    return GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))


def layout_from_config(cfg, model_cfg: GPTConfig, gpus: int) -> Layout:
    """The run's layout on `gpus` GPUs; ValueError naming the problem when the trainer would refuse it."""
    par, tr = cfg.parallel, cfg.train
    tp, pp = par.tp, par.pp
    for key, value in (("parallel.tp", tp), ("parallel.pp", pp), ("plan.gpus", gpus),
                       ("train.global_batch_size", tr.global_batch_size), ("train.micro_batch_size", tr.micro_batch_size)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r}: must be a positive integer")
    if gpus % (tp * pp):
        raise ValueError(f"plan.gpus={gpus} is not a multiple of tp·pp = {tp * pp} (parallel.tp={tp}, parallel.pp={pp})")
    selective = par.activation_checkpointing == "selective"
    layout = Layout(
        tp=tp, pp=pp, dp=gpus // (tp * pp), global_batch=tr.global_batch_size, micro_batch=tr.micro_batch_size,
        zero_stage=par.zero_stage, offload_optimizer=bool(par.offload_optimizer),
        sequence_parallel=bool(par.sequence_parallel), checkpoint_every=0 if selective else par.activation_checkpointing,
        selective_recompute=selective,
    )  # fmt: skip
    problem = layout_problem(model_cfg, layout)
    if problem:
        raise ValueError(problem)
    return layout


def implementation_from_config(cfg) -> Implementation:
    """gpt3d's implementation under the run's train.precision (auto: what it is on a GPU, bf16; the
    planner always predicts for a GPU) and train.fp8_recipe, parallel.overlap_communication and
    train.fused_loss (both true by default), and model.compile."""
    precision = cfg.train.get("precision", "auto")
    if precision == "auto":
        precision = "bf16"
    overlap, fused_loss = cfg.parallel.get("overlap_communication", True), cfg.train.get("fused_loss", True)
    if not isinstance(fused_loss, bool):
        raise ValueError(f"train.fused_loss={fused_loss!r}: must be true or false")
    return for_precision(precision, bool(overlap), fused_loss, cfg.train.get("fp8_recipe", "tensorwise"),
                         bool(cfg.model.get("compile", False)))


def hardware_from_config(plan_cfg) -> Hardware:
    overrides = OmegaConf.to_container(plan_cfg.device, resolve=True) if plan_cfg.get("device") else {}
    return preset(plan_cfg.hardware, overrides)


def gpus_of(plan_cfg, cfg) -> int:
    if plan_cfg.gpus is not None:
        return plan_cfg.gpus
    return int(os.environ.get("WORLD_SIZE", cfg.parallel.tp * cfg.parallel.pp))


def plan_from_config(cfg) -> Plan:
    """The prediction `python -m train.plan` prints for a composed config (training's plus `plan`)."""
    plan_cfg, model_cfg = cfg.plan, model_config(cfg)
    layout = layout_from_config(cfg, model_cfg, gpus_of(plan_cfg, cfg))
    _check_plan_options(plan_cfg)
    return build_plan(
        model_cfg, layout, hardware_from_config(plan_cfg), implementation=implementation_from_config(cfg),
        gpus_per_node=plan_cfg.gpus_per_node, reserved_gib=float(plan_cfg.reserved_gib), tokens=float(plan_cfg.tokens),
    )  # fmt: skip


def plan_for_run(cfg, model_cfg: GPTConfig, hardware: Hardware | None = None) -> Plan:
    """The prediction for a training run's own config: its layout on WORLD_SIZE GPUs of
    LOCAL_WORLD_SIZE per node, on the visible GPU (or `hardware`; without CUDA the h100-80g preset).
    Plan.to_json() is what to log with the run; Plan.predicted_mfu is the step log's comparison."""
    if hardware is None:
        import torch

        local = int(os.environ.get("LOCAL_RANK", 0))
        hardware = for_cuda_device(local) if torch.cuda.is_available() else preset("h100-80g")
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(world, 8)))
    return build_plan(model_cfg, layout_from_config(cfg, model_cfg, world), hardware,
                      implementation=implementation_from_config(cfg), gpus_per_node=per_node)  # fmt: skip


def _check_plan_options(plan_cfg) -> None:
    if plan_cfg.format not in FORMATS:
        raise ValueError(f"plan.format={plan_cfg.format!r}: must be one of {list(FORMATS)}")
    for key in ("gpus_per_node", "top"):
        value = plan_cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"plan.{key}={value!r}: must be a positive integer")
    for key in ("tokens", "reserved_gib"):
        value = plan_cfg[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"plan.{key}={value!r}: must be a non-negative number")


def layout_overrides(layout: Layout) -> str:
    """The command-line overrides that select `layout` (its dp follows from the world size)."""
    return " ".join([
        f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.zero_stage={layout.zero_stage}",
        f"parallel.sequence_parallel={str(layout.sequence_parallel).lower()}",
        f"parallel.activation_checkpointing={'selective' if layout.selective_recompute else layout.checkpoint_every}",
        f"train.micro_batch_size={layout.micro_batch}",
    ])  # fmt: skip


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
    )[:3]  # fmt: skip
    raise ConfigError(failure_message(plan, alternatives))

