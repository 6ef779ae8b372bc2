"""Every valid layout of a model on a number of GPUs, ranked by predicted throughput.

A layout is valid when the trainer would accept it (parallel/topology.check_layout, and the rules of
train/run/checks.py): tp divides the heads and d_ff, pp ≤ layers, tp·pp·dp = GPUs, ZeRO ≤ 1 with
pp > 1, sequence parallelism only with tp > 1 and a sequence length divisible by tp, and the global
batch divisible by micro batch × dp. The search keeps tensor parallelism inside a node (tp ≤ GPUs
per node: across nodes it is never faster) and tries micro batches up to 16 sequences or 65,536 tokens,
whichever is more (32 sequences of GPT-3's 2,048: a small model on one GPU runs fastest at the largest
micro batch that fits, its launches and its products' shapes amortised over more tokens), sequence
parallelism on and off (at any pp), activation checkpointing off, every block, or selective, and with
pp > 1 the pipeline schedules 1F1B, ZB-H1 and the interleaved schedule at each V ≥ 2 that divides the blocks a
rank holds, up to 12 (where the micro batches a step divide into groups of pp); not ZB-V, whose step the planner
times by playing its list schedule, a second or so a layout at 175B's pp and micro batches (`python -m
train.plan` with parallel.pipeline_schedule=zb-v plans it, and docs/parallelism.md compares it). Each
pipeline layout is tried with the blocks split by count and, where it is faster, with the split
train/planner/stage_split.py balances by time (parallel.stage_layers).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from model import GPTConfig
from parallel.topology import check_layout, divisors
from parallel.schedules.orders import INTERLEAVED, ONE_F_ONE_B, SCHEDULES, ZB_H1
from train.planner.estimate import build_plan
from train.planner.hardware import Hardware
from train.planner.layout import Implementation, Layout
from train.planner.results import Plan
from train.planner.stage_split import balanced_blocks

MAX_MICRO_BATCH = 16  # sequences, at least this many tried where the batch allows
MAX_MICRO_TOKENS = 65_536  # and up to this many tokens a micro batch: llm.c's 64 × 1,024 a GPU
MAX_VIRTUAL_STAGES = 12  # chunks a rank the search tries (GPT-3 175B at pp=8: every divisor of its 12 blocks)
RECOMPUTATION = ((0, False), (1, False), (0, True))  # (checkpoint_every, selective): off, every block, selective


def layout_problem(model_cfg: GPTConfig, layout: Layout) -> str | None:
    """Why the trainer would refuse `layout` for `model_cfg`, or None."""
    try:
        check_layout(model_cfg.n_head, model_cfg.d_ff, layout.tp, layout.pp, model_cfg.n_layer, layout.gpus, layout.dp)
    except ValueError as err:
        return str(err)
    if layout.zero_stage not in (0, 1, 2, 3):
        return f"parallel.zero_stage={layout.zero_stage!r}: must be one of [0, 1, 2, 3]"
    if layout.pp > 1 and layout.zero_stage > 1:
        return f"parallel.zero_stage={layout.zero_stage} with parallel.pp={layout.pp}: use ZeRO 0 or 1 with pp > 1"
    if layout.offload_optimizer and layout.zero_stage == 0:
        return "parallel.offload_optimizer=true needs parallel.zero_stage ≥ 1"
    if layout.sequence_parallel and (layout.tp == 1 or model_cfg.seq_len % layout.tp):
        return "parallel.sequence_parallel=true needs tp > 1 and model.seq_len divisible by tp"
    if layout.checkpoint_every < 0 or (layout.selective_recompute and layout.checkpoint_every):
        return (f"parallel.activation_checkpointing={layout.checkpoint_every}: must be 0 (off), a positive block "
                f"count, or selective")
    if layout.schedule not in SCHEDULES:
        return f"parallel.pipeline_schedule={layout.schedule!r}: must be one of {list(SCHEDULES)}"
    if layout.schedule != ONE_F_ONE_B and layout.pp == 1:
        return f"parallel.pipeline_schedule={layout.schedule} schedules pipeline stages: it needs parallel.pp > 1"
    if layout.virtual_stages > 1 and layout.schedule != INTERLEAVED:
        return f"parallel.virtual_stages={layout.virtual_stages}: chunks a rank are the interleaved schedule's"
    if layout.pp > 1 and layout.placement.stages > model_cfg.n_layer:
        return (f"{layout.placement.stages} virtual pipeline stages for model.n_layer={model_cfg.n_layer}: each needs "
                f"a block")
    if layout.stage_layers is not None and (len(layout.stage_layers) != layout.placement.stages
                                            or sum(layout.stage_layers) != model_cfg.n_layer):
        return (f"parallel.stage_layers={list(layout.stage_layers)}: give {layout.placement.stages} block counts "
                f"summing to model.n_layer={model_cfg.n_layer}")
    if layout.micro_batch < 1 or layout.global_batch % (layout.micro_batch * layout.dp):
        return (
            f"train.global_batch_size={layout.global_batch} is not divisible by train.micro_batch_size="
            f"{layout.micro_batch} × data-parallel size {layout.dp}"
        )
    if layout.schedule == INTERLEAVED and layout.virtual_stages > 1 and layout.micro_batches % layout.pp:
        return (f"parallel.pipeline_schedule=interleaved runs micro batches in groups of pp={layout.pp}: "
                f"{layout.micro_batches} a step do not divide into them")
    return None


def candidate_layouts(model_cfg: GPTConfig, gpus: int, global_batch: int, gpus_per_node: int) -> list[Layout]:
    """Every valid layout the search considers (module docstring)."""
    out = []
    for tp in divisors(gpus):
        if tp > gpus_per_node or model_cfg.n_head % tp or model_cfg.d_ff % tp:
            continue
        for pp in divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if pp > model_cfg.n_layer or global_batch % dp:
                continue
            most = max(MAX_MICRO_BATCH, MAX_MICRO_TOKENS // model_cfg.seq_len)
            micro = [b for b in divisors(global_batch // dp) if b <= most]
            zero = (0, 1) if pp > 1 else (0, 1, 2, 3)
            sequence = (False, True) if tp > 1 and model_cfg.seq_len % tp == 0 else (False,)
            for z, b, (ckpt, selective), sp, (schedule, chunks) in itertools.product(
                    zero, micro, RECOMPUTATION, sequence, pipeline_schedules(model_cfg.n_layer, pp)):
                if dp == 1 and z > 0:
                    continue  # ZeRO over one replica partitions nothing
                layout = Layout(tp, pp, dp, global_batch, b, z, False, sp, ckpt, selective, schedule, chunks)
                if layout_problem(model_cfg, layout) is None:
                    out.append(layout)
    return out


def search(
    model_cfg: GPTConfig, gpus: int, global_batch: int, hardware: Hardware, *, gpus_per_node: int = 8,
    reserved_gib: float = 0.0, tokens: float = 300e9, implementation: Implementation = Implementation(),
) -> list[Plan]:
    """The layouts that fit, fastest first (predicted tokens/s)."""
    plans = []
    for layout in candidate_layouts(model_cfg, gpus, global_batch, gpus_per_node):
        plan = build_plan(model_cfg, layout, hardware, implementation=implementation, gpus_per_node=gpus_per_node,
                          reserved_gib=reserved_gib, tokens=tokens)
        blocks = balanced_blocks(plan)
        if blocks is not None:
            balanced = build_plan(model_cfg, replace(layout, stage_layers=blocks), hardware, implementation=implementation,
                                  gpus_per_node=gpus_per_node, reserved_gib=reserved_gib, tokens=tokens)
            plan = balanced if balanced.fits and balanced.tokens_per_s > plan.tokens_per_s else plan
        if plan.fits:
            plans.append(plan)
    return sorted(plans, key=lambda p: -p.tokens_per_s)


def pipeline_schedules(n_layer: int, pp: int) -> list[tuple[str, int]]:
    """(parallel.pipeline_schedule, parallel.virtual_stages) the search tries at `pp` (module docstring)."""
    if pp == 1:
        return [(ONE_F_ONE_B, 1)]
    out = [(ONE_F_ONE_B, 1), (ZB_H1, 1)]
    per_rank = n_layer // pp
    out += [(INTERLEAVED, v) for v in range(2, min(per_rank, MAX_VIRTUAL_STAGES) + 1) if per_rank % v == 0]
    return out
