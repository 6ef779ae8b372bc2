"""Pre-flight: before a GPU run builds anything, predict its peak memory and stop if it cannot fit.

`python -m train` calls `preflight(cfg)` after the config check when the device is CUDA: the
planner predicts the run's layout on the visible GPU (WORLD_SIZE GPUs, LOCAL_WORLD_SIZE per node);
when the predicted peak exceeds the device's memory the run stops with one message giving that peak
and the three fastest layouts on the same GPUs, global batch and model that fit (with the planner's
default headroom for the CUDA context, plan.reserved_gib), as overrides to paste.
"""

from __future__ import annotations

from train.plan import model_config, plan_for_run
from train.plan_hardware import Hardware
from train.plan_model import Layout, Plan
from train.plan_search import search
from train.validate import ConfigError

HEADROOM_GIB = 2.0  # what the alternatives leave free (configs/plan/default.yaml: reserved_gib)


def layout_overrides(layout: Layout) -> str:
    """The command-line overrides that select `layout` (its dp follows from the world size)."""
    return " ".join([
        f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.zero_stage={layout.zero_stage}",
        f"parallel.sequence_parallel={str(layout.sequence_parallel).lower()}",
        f"parallel.activation_checkpointing={layout.checkpoint_every}", f"train.micro_batch_size={layout.micro_batch}",
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


def preflight(cfg, hardware: Hardware | None = None) -> None:
    """Raise ConfigError (see module docstring) when the run's predicted peak exceeds the device's memory."""
    try:
        plan = plan_for_run(cfg, hardware)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if plan.peak_memory_gib <= plan.hardware.memory_gib:
        return
    alternatives = search(
        model_config(cfg), plan.layout.gpus, plan.layout.global_batch, plan.hardware,
        gpus_per_node=plan.gpus_per_node, reserved_gib=HEADROOM_GIB,
    )[:3]  # fmt: skip
    raise ConfigError(failure_message(plan, alternatives))

