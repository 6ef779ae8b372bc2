"""`parallel.layout=auto`: the layout a run takes on the world size and device it actually has.

An elastic restart (torchrun --max-restarts, a SLURM requeue) may come back on fewer processes than the
run started with. Checkpoints load at any layout and record the data position layout-neutrally, so the
run continues on the same loss curve as long as the new layout keeps the global batch and the data
order. `choose_layout` picks that layout, the same on every rank (a pure function of the config, the
world size and the device model: no collective):

- valid: the trainer accepts it (train/planner/search.py: candidate_layouts, with tp ≤ processes per node),
  train.global_batch_size = micro batch · accumulation steps · dp exactly, dp and data.streams divide
  one another (a rank reads whole streams; data.streams itself is never changed, since that would change
  the data order), and every batch of a batch ramp splits into whole micro batches on every rank
  (start and increment multiples of lcm(data.streams, micro batch · dp));
- on CUDA: among the valid layouts that fit the GPU's memory with HEADROOM_GIB to spare (the planner's
  peak-memory count, train/planner/estimate.py), the one with the most predicted tokens/s;
- on a CPU there is no hardware profile, neither for speed nor for memory: the simplest valid layout,
  i.e. the most data parallelism (smallest tp·pp), then tensor before pipeline parallelism (smaller
  pp), 1F1B, ZeRO 0, no activation checkpointing, no sequence parallelism, and the largest micro batch
  (≤ 16 sequences, fewest accumulation steps). Memory is not checked on a CPU.

It fills parallel.tp, parallel.pp, parallel.zero_stage, parallel.sequence_parallel,
parallel.activation_checkpointing, parallel.offload_optimizer (false: the search does not model it),
parallel.pipeline_schedule with parallel.virtual_stages and parallel.stage_layers (the search's: 1f1b, zb-h1
or interleaved, ranked with the layouts, its stage split balanced where that is faster; 1f1b without a
pipeline) and train.micro_batch_size (AUTO_KEYS). A world size on which no layout is valid (or fits) is one ConfigError
naming the world sizes that would do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from model import GPTConfig
from train.config.sections.parallel import AUTO, ONE_F_ONE_B
from train.config.settings import ConfigError
from train.planner.estimate import Layout, Plan
from train.planner.hardware import Hardware
from train.planner.search import MAX_MICRO_BATCH, candidate_layouts, search

HEADROOM_GIB = 2.0  # left free for the CUDA context, NCCL and the allocator (as pre-flight's alternatives)


@dataclass(frozen=True)
class DataOrder:
    """What a layout must respect to keep the run's data order: data.streams and the batch ramp's
    start and increment in sequences (None when there is no ramp)."""

    streams: int
    ramp_steps: tuple[int, int] | None = None

    def allows(self, layout: Layout) -> bool:
        if self.streams % layout.dp and layout.dp % self.streams:
            return False
        unit = math.lcm(self.streams, layout.micro_batch * layout.dp)
        return self.ramp_steps is None or all(n % unit == 0 for n in self.ramp_steps)


@dataclass(frozen=True)
class LayoutChoice:
    """The chosen layout for `processes` processes on `device`, and why."""

    layout: Layout
    processes: int
    device: str  # "cpu", or the GPU's name
    valid: int  # layouts valid for this world size, global batch and data order
    fitting: int  # of those, the ones that fit memory (on a CPU: all valid ones)
    plan: Plan | None  # the planner's prediction of the chosen layout (CUDA)

    def values(self) -> dict:
        """{dotted config key: value} that select the layout (AUTO_KEYS)."""
        lay = self.layout
        return {
            "parallel.tp": lay.tp, "parallel.pp": lay.pp, "parallel.zero_stage": lay.zero_stage,
            "parallel.sequence_parallel": lay.sequence_parallel,
            "parallel.activation_checkpointing": "selective" if lay.selective_recompute else lay.checkpoint_every,
            "parallel.offload_optimizer": False, "parallel.pipeline_schedule": lay.schedule,
            "parallel.virtual_stages": lay.virtual_stages,
            "parallel.stage_layers": list(lay.stage_layers) if lay.stage_layers is not None else None,
            "train.micro_batch_size": lay.micro_batch,
        }

    @property
    def reason(self) -> str:
        if self.plan is None:
            return (f"the most data parallelism of {self.valid} valid layouts: a CPU has no speed or memory profile, "
                    "so tp before pp, 1F1B, ZeRO 0, no checkpointing, the largest micro batch")
        return (f"fastest of {self.fitting} that fit of {self.valid} valid: {self.plan.tokens_per_s:,.0f} tokens/s "
                f"predicted, peak {self.plan.peak_memory_gib:.1f} GiB of {self.plan.hardware.memory_gib:.1f}")

    def line(self) -> str:
        """The one line a run prints about its choice."""
        return f"layout {AUTO} for {self.processes} processes on {self.device}: {self.layout.describe()} ({self.reason})"

    def to_json(self) -> dict:
        """What the metrics and W&B record of the choice."""
        lay = self.layout
        return {
            "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "zero_stage": lay.zero_stage, "micro_batch": lay.micro_batch,
            "activation_checkpointing": "selective" if lay.selective_recompute else lay.checkpoint_every,
            "sequence_parallel": lay.sequence_parallel, "pipeline_schedule": lay.schedule,
            "virtual_stages": lay.virtual_stages, "stage_layers": lay.stage_layers,
            "processes": self.processes, "device": self.device, "valid": self.valid, "fitting": self.fitting,
            "reason": self.reason,
        }


def choose_layout(
    model_cfg: GPTConfig, processes: int, global_batch: int, order: DataOrder, hardware: Hardware | None,
    processes_per_node: int,
) -> LayoutChoice:
    """The layout for `processes` processes (module docstring); `hardware` None means a CPU. Raises
    ConfigError when none is valid or fits, naming the world sizes that would do."""
    choice = _choose(model_cfg, processes, global_batch, order, hardware, processes_per_node)
    if choice is not None:
        return choice
    sizes = _other_sizes(processes, processes_per_node, hardware)
    would = [n for n in sizes if _choose(model_cfg, n, global_batch, order, hardware, min(n, processes_per_node))]
    what = "is valid" if hardware is None else f"fits {hardware.name} with {HEADROOM_GIB:g} GiB to spare"
    step = "" if sizes[0] == 1 else f" (whole nodes of {processes_per_node})"
    raise ConfigError(
        f"parallel.layout={AUTO}: no layout of {processes} processes {what} for model {model_cfg.name} "
        f"({model_cfg.n_layer} layers, {model_cfg.n_head} heads) with train.global_batch_size={global_batch} and "
        f"data.streams={order.streams} (dp must divide it or be a multiple of it); world sizes up to {sizes[-1]}"
        f"{step} that would: {would or 'none'}"
    )


def _choose(model_cfg: GPTConfig, processes: int, global_batch: int, order: DataOrder, hardware: Hardware | None,
            processes_per_node: int) -> LayoutChoice | None:
    valid = [lay for lay in candidate_layouts(model_cfg, processes, global_batch, processes_per_node) if order.allows(lay)]
    if not valid:
        return None
    if hardware is None:
        best = min(valid, key=_simplicity)
        return LayoutChoice(best, processes, "cpu", len(valid), len(valid), None)
    fitting = [p for p in search(model_cfg, processes, global_batch, hardware, gpus_per_node=processes_per_node,
                                 reserved_gib=HEADROOM_GIB) if order.allows(p.layout)]
    if not fitting:
        return None
    best = fitting[0]  # the fastest; of equals the first in candidate order: the same on every rank
    return LayoutChoice(best.layout, processes, hardware.name, len(valid), len(fitting), best)


def _simplicity(layout: Layout) -> tuple:
    """The CPU rule's order (module docstring): smaller is simpler."""
    return (layout.tp * layout.pp, layout.pp, layout.schedule != ONE_F_ONE_B, layout.zero_stage,
            layout.checkpoint_every, layout.selective_recompute, layout.sequence_parallel,
            layout.micro_batch > MAX_MICRO_BATCH, -layout.micro_batch)


def _other_sizes(processes: int, per_node: int, hardware: Hardware | None) -> list[int]:
    """The world sizes a no-fit error considers: every count up to twice this one, or on GPUs spanning
    nodes, whole nodes up to twice as many."""
    if hardware is None or processes <= per_node:
        return list(range(1, 2 * processes + 1))
    return list(range(per_node, 2 * processes + 1, per_node))
