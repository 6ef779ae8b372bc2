"""Plain-text tables of a Plan (per rank: first, middle and last pipeline stage) and of a search."""

from __future__ import annotations

import dataclasses

from train.planner.estimate import (
    GIB,
    Plan,
    build_plan,
    chunk_reductions_run,
    ring_runs,
    uses_bf16_optimizer,
    zero_optimizer_reduces,
)
from train.planner.fp8_rule import HEAD_IN_BF16, choice_for

STAGE_NAMES = {1: ["every stage"], 2: ["first stage", "last stage"], 3: ["first stage", "middle stage", "last stage"]}


def _count(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _bytes(n: float) -> str:
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _comm(rank, group: str) -> str:
    ops = {}
    for t in rank.transfers:
        if t.group == group:
            ops[t.op] = ops.get(t.op, 0) + t.total
    return ", ".join(f"{op.replace('_', '-')} {_bytes(n)}" for op, n in sorted(ops.items())) or "none"


def format_plan(plan: Plan) -> str:
    """The table `python -m train.plan` prints."""
    cfg, lay, hw = plan.model, plan.layout, plan.hardware
    ranks = plan.ranks
    names = STAGE_NAMES[len(ranks)]
    peak_total = {r.stage: r.peak_bytes for r in ranks}
    impl = plan.implementation
    weights = "bf16" if impl.bf16_weights else "fp32"  # fp8 computes from bf16 weights
    # BF16_Optimizer's gradients at the step are its fp32 accumulation buffer (its bf16 ones: estimate.bf16_gradient_bytes)
    grads = "fp32" if uses_bf16_optimizer(plan.layout.zero_stage, impl) else weights
    rows = [
        ("pipeline stage", [str(r.stage) for r in ranks]),
        *([("virtual stages", [",".join(map(str, r.chunks)) for r in ranks])] if lay.placement.virtual > 1 else []),
        ("transformer blocks", [str(_blocks(plan, r)) for r in ranks]),
        ("parameters", [_count(r.parameters) for r in ranks]),
        (f"weights ({weights})", [_gib(r.state.weights) for r in ranks]),
        (f"gradients ({grads}) at the step", [_gib(r.state.gradients) for r in ranks]),
        ("fp32 master weights", [_gib(r.state.master) for r in ranks]),
        ("Adam moments", [_gib(r.state.moments) for r in ranks]),
        ("ZeRO buffers", [_gib(r.state.buffers) for r in ranks]),
        ("host memory (offload)", [_gib(r.state.host) for r in ranks]),
        ("activations / micro batch", [_gib(r.activations.activations) for r in ranks]),
        ("autocast weight copies / micro batch", [_gib(r.activations.weight_copies) for r in ranks]),
        ("micro batches in flight" if lay.placement.virtual == 1 else "chunk micro batches in flight",
         [str(r.in_flight) for r in ranks]),
        *([("deferred W inputs and gradients / micro batch", [_gib(r.deferred_bytes) for r in ranks]),
           (f"deferred W passes held ({lay.schedule})", [str(r.deferred) for r in ranks])]
          if lay.defers_weight_grads else []),
        ("peak memory", [_gib(peak_total[r.stage]) for r in ranks]),
        ("peak memory by kind, GiB", [", ".join(f"{k} {v / GIB:.1f}" for k, v in r.memory.items() if v) for r in ranks]),
        ("hardware FLOPs / step", [f"{r.hardware_flops:.3g}" for r in ranks]),
        ("tensor-parallel bytes / step", [_comm(r, "tp") for r in ranks]),
        ("pipeline bytes / step", [_comm(r, "pp") for r in ranks]),
        ("data-parallel bytes / step", [_comm(r, "dp") for r in ranks]),
        ("micro batch: compute", [_ms(r.time["compute_s"]) for r in ranks]),
        ("micro batch: tp / pp / ZeRO-3 comm", [" / ".join(_ms(r.time[k]) for k in ("tp_comm_s", "pp_comm_s", "zero3_gather_s")) for r in ranks]),
        *([("micro batch: F / B / W passes", [" / ".join(_ms(p) for p in dataclasses.astuple(r.passes)) for r in ranks])]
          if lay.pp > 1 else []),
        ("step: dp comm + optimizer", [_ms(r.time["dp_comm_s"] + r.time["optimizer_s"]) for r in ranks]),
    ]
    label = max(len(name) for name, _ in rows) + 2
    width = max(14, *(len(v) for _, values in rows for v in values if len(v) < 30)) + 2
    lines = [
        f"{cfg.name}: {_count(plan.parameters)} parameters, {cfg.n_layer} layers, "
        f"d_model {cfg.d_model}, {cfg.n_head} heads, sequence {cfg.seq_len}",
        f"layout: {lay.describe()} on {lay.gpus} × {hw.name} ({hw.memory_gib:g} GiB, {hw.peak_tflops:g} TFLOP/s bf16)",
        f"precision: {plan.implementation.precision}; communication overlapped: "
        f"{_overlaps(plan) or 'none'}",
        *fp8_lines(plan),
        f"batch: {lay.global_batch} sequences = {_count(plan.tokens_per_step)} tokens per step, "
        f"{lay.micro_batches} micro batches of {lay.micro_batch} per replica, pipeline bubble {100 * plan.bubble:.1f}%",
        *stage_split_lines(plan),
        "",
        " " * label + "".join(f"{n:>{width}}" for n in names),
    ]
    for name, values in rows:
        if len(max(values, key=len)) >= 30:  # long entries: a line per stage under the row's name
            lines.append(name)
            lines += [f"  {stage_name:<{label - 2}}{value}" for stage_name, value in zip(names, values)]
        else:
            lines.append(f"{name:<{label}}" + "".join(f"{v:>{width}}" for v in values))
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines += ["", *format_breakdown(plan)]
    lines += [
        "",
        f"peak memory {plan.peak_memory_gib:.2f} GiB + {plan.reserved_gib:g} GiB reserved of {hw.memory_gib:g} GiB: {verdict}",
        f"step {plan.step_time_s:.3f} s | {plan.tokens_per_s:,.0f} tokens/s | model {plan.model_tflops_per_gpu:.0f} TFLOP/s per GPU "
        f"(MFU {100 * plan.predicted_mfu:.1f}%) | hardware {plan.hardware_tflops_per_gpu:.0f} TFLOP/s per GPU",
        f"{_count(plan.tokens)} tokens in {plan.days:.1f} days",
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def fp8_summary(plan: Plan) -> dict | None:
    """Under fp8: the fp8 rule's choice at the plan's layout (train/planner/fp8_rule.py), and its predicted gain,
    the step time of the same layout in bf16 (compiled or not alike) over the plan's; None otherwise."""
    impl, lay = plan.implementation, plan.layout
    if impl.fp8 is None:
        return None
    choice = choice_for(plan.model, lay.tp, lay.micro_batch, impl.fp8, impl.fp8_linears, plan.hardware.preset)
    bf16 = build_plan(plan.model, lay, plan.hardware, implementation=dataclasses.replace(impl, fp8=None),
                      gpus_per_node=plan.gpus_per_node, reserved_gib=plan.reserved_gib, tokens=plan.tokens)
    return {"choice": choice, "bf16_step_s": bf16.step_time_s, "gain": bf16.step_time_s / plan.step_time_s}


def fp8_lines(plan: Plan) -> list[str]:
    """The lines `python -m train.plan` prints under fp8: which linears, and the predicted gain."""
    summary = fp8_summary(plan)
    if summary is None:
        return []
    choice, head = summary["choice"], summary["choice"].head
    pays = (f"; the rule alone would take its {head.tokens} × {head.in_features} × {head.out_features} products to "
            f"float8" if head.rule else "")
    return [choice.line(),
            f"  predicted gain: step {plan.step_time_s:.4g} s against {summary['bf16_step_s']:.4g} s in bf16 at this "
            f"layout, {summary['gain']:.2f}× ({'compiled' if plan.implementation.compiled else 'eager'} blocks)",
            f"  head in bf16: {HEAD_IN_BF16}{pays}"]


def _overlaps(plan: Plan) -> str:
    impl, parts = plan.implementation, []
    lay = plan.layout
    if impl.overlap_tp and lay.tp > 1 and not lay.sequence_parallel and not lay.defers_weight_grads:
        parts.append("tensor-parallel input gradients behind weight gradients")
    if ring_runs(lay, impl):
        parts.append("tensor-parallel gathers and reduce-scatters in ring steps behind the GEMM chunks"
                     + (" (the gathers in float8)" if impl.fp8 == "tensorwise" else ""))
    if impl.overlap_dp and lay.dp > 1 and lay.pp == 1 and zero_optimizer_reduces(lay.zero_stage, impl) and lay.zero_stage < 3:
        parts.append("ZeRO gradient reduction behind the backward")
    if chunk_reductions_run(lay, impl):
        parts.append("data-parallel gradients reduced chunk by chunk behind the backward")
    return ", ".join(parts)


def format_breakdown(plan: Plan) -> list[str]:
    """Where the step goes: the pipeline's time by part of the slowest stage's micro batch (each part
    times the pipeline's seconds over the micro batch's: 1F1B's m + pp − 1 slots, the other schedules' m
    micro batches and their bubble), the bubble's share of it, and what follows the last micro batch."""
    lay, pipeline = plan.layout, plan.pipeline
    slowest, micro_batch_s = pipeline.slowest, pipeline.passes.total
    slots = pipeline.seconds / micro_batch_s
    last = max(plan.ranks, key=lambda r: r.time["dp_comm_s"] + r.time["optimizer_s"])
    parts = [("compute (GEMMs, attention, memory-bound kernels)", slowest.time["compute_s"] * slots),
             ("tensor-parallel communication, exposed", slowest.time["tp_comm_s"] * slots),
             ("pipeline sends", slowest.time["pp_comm_s"] * slots),
             ("ZeRO-3 parameter gathers", slowest.time["zero3_gather_s"] * slots),
             ("data-parallel communication, exposed", last.time["dp_comm_s"]),
             ("optimizer step", last.time["optimizer_s"])]
    if lay.pp > 1 and lay.schedule != "1f1b":
        f, b, w = (_ms(x) for x in dataclasses.astuple(pipeline.passes))
        lines = [f"step time {plan.step_time_s:.3f} s: {lay.micro_batches} of stage {slowest.stage}'s micro batch "
                 f"({_ms(micro_batch_s)}: F {f}, B {b}, W {w}) and the {lay.schedule} bubble, worth "
                 f"{slots - lay.micro_batches:.2f} of them, then the step"]
    else:
        lines = [f"step time {plan.step_time_s:.3f} s: {slots:.0f} slots of stage {slowest.stage}'s micro batch "
                 f"({_ms(micro_batch_s)}, {lay.pp - 1} of them the bubble), then the step"]
    lines += [f"  {name:<52}{seconds:>9.3f} s {100 * seconds / plan.step_time_s:>6.1f}%" for name, seconds in parts if seconds]
    if pipeline.bubble_s:
        bubble = pipeline.bubble_s
        lines.append(f"  {'of the above, the pipeline bubble':<52}{bubble:>9.3f} s {100 * bubble / plan.step_time_s:>6.1f}%")
    return lines


def _blocks(plan: Plan, rank) -> int:
    """The transformer blocks of a rank, over all its chunks."""
    from train.planner.counts import stage_blocks

    placement, spec = plan.layout.placement, plan.layout.stage_layers
    return sum(len(stage_blocks(plan.model.n_layer, placement.stages, v, spec)) for v in rank.chunks)


def stage_split_lines(plan: Plan) -> list[str]:
    """With a pipeline: each virtual stage's blocks (the embedding on the first, the head and loss on the last)
    and one micro batch's compute through it, first to last."""
    from train.planner.counts import stage_blocks

    lay = plan.layout
    if lay.pp == 1:
        return []
    placement = lay.placement
    stages = [len(stage_blocks(plan.model.n_layer, placement.stages, v, lay.stage_layers)) for v in range(placement.stages)]
    if len(set(stages)) == 1 and len(stages) > 8:
        stages = f"{stages[0]} × {len(stages)}"
    split = "parallel.stage_layers" if lay.stage_layers is not None else "balanced by count"
    return [f"stage split: blocks {stages} ({split}); compute per micro batch {_runs(plan.stage_seconds)}"]


def _runs(seconds: tuple[float, ...]) -> str:
    """Each virtual stage's time, runs of one value shown once ("stages 1–94 2.16 ms")."""
    shown, start = [], 0
    values = [_ms(t) for t in seconds]
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            where = f"stage {start}" if i - start == 1 else f"stages {start}–{i - 1}"
            shown.append(f"{where} {values[start]}")
            start = i
    return ", ".join(shown)


def format_search(plans: list[Plan], top: int) -> str:
    """The ranked layouts `plan.search=true` prints."""
    if not plans:
        return "no valid layout fits"
    lines = [f"{'#':>3}  {'layout':<52} {'tokens/s':>11} {'MFU':>6} {'peak GiB':>9} {'days':>7}"]
    for i, plan in enumerate(plans[:top], 1):
        lines.append(
            f"{i:>3}  {plan.layout.describe():<52} {plan.tokens_per_s:>11,.0f} {100 * plan.predicted_mfu:>5.1f}% "
            f"{plan.peak_memory_gib:>9.1f} {plan.days:>7.1f}"
        )
    lines.append(f"{len(plans)} layouts fit; {min(top, len(plans))} shown (plan.top)")
    return "\n".join(lines)
