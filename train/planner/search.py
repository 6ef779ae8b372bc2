"""Every valid layout of a model on a number of GPUs, ranked by predicted throughput.

A layout is valid when the trainer would accept it (parallel/topology.check_layout, and the rules of
train/run/checks.py): tp divides the heads and d_ff, pp ≤ layers, tp·pp·dp = GPUs, ZeRO ≤ 1 with
pp > 1, sequence parallelism only with tp > 1 and a sequence length divisible by tp, and the global
batch divisible by micro batch × dp. The search keeps tensor parallelism inside a node (tp ≤ GPUs
per node: across nodes it is never faster) and tries micro batches up to 16 sequences or 65,536 tokens,
whichever is more (32 sequences of GPT-3's 2,048: a small model on one GPU runs fastest at the largest
micro batch that fits, its launches and its products' shapes amortised over more tokens), sequence
parallelism on and off (at any pp), activation checkpointing off, every block, or selective, and with
pp > 1 both pipeline schedules, 1F1B and ZB-H1 (not ZB-H1 with model.compile, which the trainer refuses:
compiled blocks would trace the deferred weight gradients).
"""

from __future__ import annotations

import itertools

from model import GPTConfig
from parallel.topology import check_layout, divisors
from train.config.sections.parallel import ONE_F_ONE_B, PIPELINE_SCHEDULES, ZB_H1
from train.planner.estimate import Implementation, Layout, Plan, build_plan
from train.planner.hardware import Hardware

MAX_MICRO_BATCH = 16  # sequences, at least this many tried where the batch allows
MAX_MICRO_TOKENS = 65_536  # and up to this many tokens a micro batch: llm.c's 64 × 1,024 a GPU
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
    if layout.schedule not in PIPELINE_SCHEDULES:
        return f"parallel.pipeline_schedule={layout.schedule!r}: must be one of {list(PIPELINE_SCHEDULES)}"
    if layout.schedule == ZB_H1 and layout.pp == 1:
        return "parallel.pipeline_schedule=zb-h1 schedules pipeline stages: it needs parallel.pp > 1"
    if layout.schedule == ZB_H1 and model_cfg.compile:
        return ("parallel.pipeline_schedule=zb-h1 with model.compile=true: the compiled blocks would trace the deferred "
                "weight gradients")
    if layout.micro_batch < 1 or layout.global_batch % (layout.micro_batch * layout.dp):
        return (
            f"train.global_batch_size={layout.global_batch} is not divisible by train.micro_batch_size="
            f"{layout.micro_batch} × data-parallel size {layout.dp}"
        )
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
            schedules = PIPELINE_SCHEDULES if pp > 1 else (ONE_F_ONE_B,)
            for z, b, (ckpt, selective), sp, schedule in itertools.product(zero, micro, RECOMPUTATION, sequence,
                                                                           schedules):
                if dp == 1 and z > 0:
                    continue  # ZeRO over one replica partitions nothing
                layout = Layout(tp, pp, dp, global_batch, b, z, False, sp, ckpt, selective, schedule)
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
        if plan.fits:
            plans.append(plan)
    return sorted(plans, key=lambda p: -p.tokens_per_s)
