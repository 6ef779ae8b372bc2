"""Pipeline schedules in the planner (parallel.pipeline_schedule): 1F1B, ZB-H1, the interleaved schedule and
ZB-V, each against an independent reference.

The step of the pipeline against Qi et al.'s and Narayanan et al.'s formulas worked out by hand and against
the programs the engine runs (parallel/schedules/program.py: the passes of each rank's instructions, timed
here by a simulation of this file's own); the exposed tensor-parallel time against the all-reduce's bytes
over the link; the memory against the linears' shapes and a walk over the engine's programs; the search
against its candidates; the 175B recipe's layout at the figures docs/planner.md states.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import GPTConfig
from parallel.schedules.orders import (
    INTERLEAVED,
    ONE_F_ONE_B,
    ZB_H1,
    ZB_V,
    Costs,
    one_f_one_b,
    placement_of,
    predicted_bubble,
    timeline,
)
from parallel.schedules.placement import Placement
from parallel.schedules.program import Forward, InputGradPass, WeightGradPass, rank_program
from train.planner.counts import stage_blocks
from train.planner.estimate import (
    COLLECTIVE_LATENCY_S,
    _per_weight_bytes,
    build_plan,
)
from train.planner.hardware import preset
from train.planner.layout import Layout, for_precision
from train.planner.pipeline_time import Passes, chunks_held_at_peak, held_at_peak, pipeline_seconds
from train.planner.search import candidate_layouts, layout_problem, search
from train.planner.tables import format_plan, format_search

H100 = preset("h100-80g")
CFG = GPTConfig(name="6.7b-8", n_layer=8, n_head=32, d_model=4096, seq_len=2048)  # GEMM-bound, not host-bound
N, D, F = 2 * 2048, 4096, 4 * 4096  # tokens of a micro batch, d_model, d_ff
BF16, AUTOCAST = for_precision("bf16"), for_precision("autocast")
ZB = Layout(2, 4, 1, 16, 2, schedule=ZB_H1)  # m = 8 micro batches of 2 through 4 stages of 2 blocks, tp = 2
ONE_F = dataclasses.replace(ZB, schedule=ONE_F_ONE_B)


def _engine_step(orders, costs: Costs) -> float:
    return max(stage[-1][4] for stage in timeline(orders, costs))


def program_passes(schedule: str, placement: Placement, m: int, rank: int, costs: Costs = Costs()) -> list:
    """The passes rank `rank`'s program runs, in order: [(kind, virtual stage, buffer)] (W: the oldest B's)."""
    passes, deferred = [], []
    for i in rank_program(schedule, placement, m, rank, costs):
        if isinstance(i, Forward):
            passes.append(("F", i.stage, i.buffer_id))
        elif isinstance(i, InputGradPass):
            passes.append(("B", i.stage, i.buffer_id))
            deferred.append((i.stage, i.buffer_id))
        elif isinstance(i, WeightGradPass):
            passes.append(("W", *deferred.pop(0)))
    return passes


def simulated_step(schedule: str, placement: Placement, m: int, chunk: Costs, costs_for_order: Costs = Costs()) -> float:
    """The programs of every rank played by a simulation written here: a pass starts when its rank is free and
    the pass it needs has ended (the previous stage's forward, the next stage's B, the stage's own forward
    for the loss's B), with `chunk`'s times; B is the whole backward where the schedule does not split W."""
    split = schedule in (ZB_H1, ZB_V)
    times = {"F": chunk.forward, "B": chunk.input_grad if split else chunk.input_grad + chunk.weight_grad,
             "W": chunk.weight_grad}
    programs = [program_passes(schedule, placement, m, r, costs_for_order) for r in range(placement.pp)]
    last, ends, clock, at = placement.stages - 1, {}, [0.0] * placement.pp, [0] * placement.pp
    while any(at[r] < len(programs[r]) for r in range(placement.pp)):
        for r, program in enumerate(programs):
            while at[r] < len(program):
                kind, v, buffer = program[at[r]]
                j = buffer % m
                needs = {"F": ("F", v - 1, j) if v else None, "W": None,
                         "B": ("B", v + 1, j) if v < last else ("F", v, j)}[kind]
                if needs is not None and needs not in ends:
                    break
                clock[r] = max(clock[r], ends.get(needs, 0.0)) + times[kind]
                ends[(kind, v, j)] = clock[r]
                at[r] += 1
    return max(clock)


def test_zb_h1_bubble_is_the_papers_and_the_schedules_own():
    """Under autocast (no BF16_Optimizer pass in W, so W ≤ min(F, B) here)."""
    plan = build_plan(CFG, ZB, H100, implementation=AUTOCAST)
    baseline = build_plan(CFG, ONE_F, H100, implementation=AUTOCAST)
    p, m = 4, 8
    f, b, w = dataclasses.astuple(plan.pipeline.passes)
    assert w <= min(f, b)  # where Qi et al.'s form holds
    by_hand = (p - 1) * (f + b - w) / (m * (f + b + w) + (p - 1) * (f + b - w))
    assert plan.bubble == pytest.approx(by_hand, rel=1e-12)
    assert plan.bubble == pytest.approx(predicted_bubble(ZB_H1, Placement(p), m, Costs(f, b, w)), rel=1e-9)
    slowest = plan.pipeline.slowest
    dp_and_optimizer = max(r.time["dp_comm_s"] + r.time["optimizer_s"] for r in plan.ranks)
    assert plan.step_time_s == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w) + dp_and_optimizer, rel=1e-12)
    assert f + b + w == pytest.approx(slowest.time["micro_batch_s"], rel=1e-12)
    # 1F1B: (p − 1)/(m + p − 1), the schedule's own timeline with B and W as one backward
    assert baseline.bubble == pytest.approx(3 / 11, rel=1e-12)
    baseline_costs = Costs(*dataclasses.astuple(baseline.pipeline.passes))
    assert baseline.bubble == pytest.approx(predicted_bubble(ONE_F_ONE_B, Placement(p), m, baseline_costs), rel=1e-9)
    assert plan.bubble < baseline.bubble


@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 1.4, 0.7), (0.8, 2.0, 0.9), (2.0, 0.5, 1.0),
                                   (1.0, 0.5, 3.0), (1.0, 2.0, 0.0)],
                         ids=["equal", "w-smallest", "w-above-f", "w-above-b", "w-largest", "no-w"])
def test_pipeline_seconds_is_the_engines_order_timed_at_any_m_and_costs(costs):
    """The closed forms against the programs the engine runs, played by this file's simulation: ZB-H1 (its
    order built for equal passes) for fewer micro batches than stages too, 1F1B, and the interleaved schedule
    (Narayanan et al.'s (V·m + p − 1)·T/V) at V = 2 and 3; ZB-V as the planner plays its order."""
    f, b, w = costs
    for p in (2, 3, 4):
        for m in range(1, 3 * p + 1):
            engine = simulated_step(ZB_H1, Placement(p), m, Costs(f, b, w))
            assert pipeline_seconds(ZB_H1, Placement(p), m, Passes(f, b, w)) == pytest.approx(engine, rel=1e-12), (p, m)
            one_f = _engine_step([one_f_one_b(p, m, s) for s in range(p)], Costs(f, b + w, 0.0))
            assert pipeline_seconds(ONE_F_ONE_B, Placement(p), m, Passes(f, b, w)) == pytest.approx(one_f, rel=1e-12)
        for chunks, m in ((2, 2 * p), (3, p)):
            placement = Placement(p, chunks)
            engine = simulated_step(INTERLEAVED, placement, m, Costs(f / chunks, b / chunks, w / chunks))
            closed = pipeline_seconds(INTERLEAVED, placement, m, Passes(f, b, w))
            assert closed == pytest.approx(engine, rel=1e-12) == pytest.approx((chunks * m + p - 1) * (f + b + w) / chunks)
    p, m = 4, 8
    shares = Costs(*Passes(f, b, w).shares())
    engine = simulated_step(ZB_V, placement_of(ZB_V, p), m, Costs(f / 2, b / 2, w / 2), shares)
    assert pipeline_seconds(ZB_V, placement_of(ZB_V, p), m, Passes(f, b, w)) == pytest.approx(engine, rel=1e-12)
    assert engine >= (p - 1) * f / 2 + m * (f + b + w) - 1e-12  # the last rank's start, then all its work


def test_zb_h1_exposes_the_whole_input_gradient_all_reduce():
    """Under 1F1B the column layers' input-gradient all-reduces hide behind their weight-gradient GEMMs
    (here each is shorter than its GEMM: hidden whole); under ZB-H1 those GEMMs are deferred and each
    all-reduce is exposed in full: 2(g − 1)/g of its bytes over NVLink plus the collective's latency."""
    tp_s = {s: build_plan(CFG, dataclasses.replace(ZB, schedule=s), H100, implementation=i).ranks[0].time["tp_comm_s"]
            for s, i in ((ZB_H1, BF16), (ONE_F_ONE_B, BF16))}
    serial = build_plan(CFG, ONE_F, H100, implementation=for_precision("bf16", overlap_communication=False))
    tp = 2
    all_reduce = 2 * (tp - 1) / tp * N * D * 2 / H100.link_bandwidth(False) + COLLECTIVE_LATENCY_S  # bf16
    qkv_gemm = 2 * N * D * (3 * D // tp) / H100.flops
    assert all_reduce < qkv_gemm  # so 1F1B hides it whole
    blocks = len(stage_blocks(CFG.n_layer, 4, 0))
    assert tp_s[ZB_H1] - tp_s[ONE_F_ONE_B] == pytest.approx(2 * blocks * all_reduce, rel=1e-9)
    assert tp_s[ZB_H1] == pytest.approx(serial.ranks[0].time["tp_comm_s"], rel=1e-12)
    zb_table = format_plan(build_plan(CFG, ZB, H100, implementation=BF16))
    assert "communication overlapped: none" in zb_table and "layout: tp=2 pp=4 dp=1 zero=0 micro=2 ckpt=off zb-h1" in zb_table


def test_each_gradient_passes_the_bf16_optimizers_update_once_in_b_or_in_w():
    """Per micro batch under BF16_Optimizer every bf16 gradient is added to its fp32 copy once
    (BF16_OPTIMIZER_UPDATE_BYTES, 10 bytes a parameter: the op ledger's count below). DeepSpeed's 1F1B also clears and accumulates it
    (_per_weight_bytes); gpt3d's schedule engine drops each once added, so the next backward writes it fresh:
    _per_weight_bytes fewer for every parameter of the rank, under ZB-H1 and the interleaved schedule alike;
    under ZB-H1 the parameters W computes (the four linears' weights, the column layers' biases) are added in
    W: 10 bytes there, 10 fewer in B. Without BF16_Optimizer (autocast) the schedules' per-parameter traffic
    is the same."""
    tp = 2
    per_block = (3 * D * D + D * D + F * D + D * F + 3 * D + F) // tp  # counted here from the shapes
    interleaved = dataclasses.replace(ZB, schedule=INTERLEAVED, virtual_stages=2, global_batch=32)
    for implementation, bf16_optimizer in ((BF16, True), (AUTOCAST, False)):
        one_f = build_plan(CFG, ONE_F, H100, implementation=implementation).ranks
        for layout, defers in ((ZB, True), (interleaved, False)):
            own = build_plan(CFG, layout, H100, implementation=implementation).ranks
            base = one_f if layout is ZB else build_plan(CFG, dataclasses.replace(ONE_F, global_batch=32), H100,
                                                         implementation=implementation).ranks
            for a, b in zip(own, base):
                deferred = len(stage_blocks(CFG.n_layer, 4, a.stage)) * per_block if defers else 0
                w_extra = deferred * 10 / H100.memory_bandwidth if bf16_optimizer else 0.0
                saved = a.parameters * _per_weight_bytes(BF16) / H100.memory_bandwidth if bf16_optimizer else 0.0
                assert a.parameters == b.parameters
                assert a.time["weight_grad_s"] - b.time["weight_grad_s"] == pytest.approx(w_extra, rel=1e-9, abs=1e-15)
                assert b.time["compute_s"] - a.time["compute_s"] == pytest.approx(saved, rel=1e-9, abs=1e-15)
    tp, blocks = 2, 2
    products = sum(2 * N * k * m / H100.flops for k, m in ((D, 3 * D // tp), (D // tp, D), (D, F // tp), (F // tp, D)))
    bias_sums = 2 * N * (3 * D + F) / tp / H100.memory_bandwidth  # read g of attn.qkv and mlp.fc, bf16
    middle = build_plan(CFG, ONE_F, H100, implementation=BF16).ranks[1]
    assert middle.time["weight_grad_s"] == pytest.approx(blocks * (products + bias_sums), rel=1e-9)


def test_the_bf16_optimizers_update_is_one_kernel_of_10_bytes_a_parameter():
    """What gpt3d runs for BF16_Optimizer's per-micro-batch update (train/run/bf16_optimizer.py: DeviceStepBF16), as
    bench/op_ledger.py counts it: one kernel a parameter, moving BF16_OPTIMIZER_UPDATE_BYTES an element (the bf16
    gradient read, the fp32 one read and written), and the sums exact."""
    from types import SimpleNamespace

    from bench.op_ledger import OpLedger
    from train.planner.estimate import BF16_OPTIMIZER_UPDATE_BYTES
    from train.run.bf16_optimizer import DeviceStepBF16

    params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in ((5, 7), (7,), (3, 4, 2))]
    for p in params:
        p.grad = torch.randn(p.shape).bfloat16()
    fp32 = [torch.randn(p.numel()) for p in params]
    expected = [g + p.grad.float().flatten() for g, p in zip(fp32, params)]
    optimizer = SimpleNamespace(fp32_groups_gradients=[fp32], fp32_groups_has_gradients=[[False] * 3])
    ledger = OpLedger()
    with ledger:
        ledger.recording = True
        for j, p in enumerate(params):
            DeviceStepBF16._update_hp_grad(optimizer, p, 0, j, clear_lp_grads=False)
    kernels = [op for op in ledger.ops if op.kernels]
    assert sum(op.kernels for op in kernels) == len(params)
    assert sum(op.bytes for op in kernels) == BF16_OPTIMIZER_UPDATE_BYTES * sum(p.numel() for p in params) == 10 * (35 + 7 + 24)
    assert all(torch.equal(g, e) for g, e in zip(fp32, expected))


def _deferred_by_hand(blocks: int, n: int, d: int, f: int, tp: int) -> int:
    """Every block linear's input x and output gradient g, bf16: (in, out) features on a rank."""
    linears = [(d, 3 * d // tp), (d // tp, d), (d, f // tp), (f // tp, d)]  # qkv, attn.proj, fc, mlp.proj
    return blocks * n * 2 * sum(k + m for k, m in linears)


def test_zb_h1_stage_memory_is_1f1bs_plus_s_deferred_weight_gradients():
    zb, one_f = build_plan(CFG, ZB, H100, implementation=BF16), build_plan(CFG, ONE_F, H100, implementation=BF16)
    assert [r.stage for r in zb.ranks] == [0, 2, 3]
    for a, b in zip(zb.ranks, one_f.ranks):
        deferred = _deferred_by_hand(len(stage_blocks(CFG.n_layer, 4, a.stage)), N, D, F, 2)
        assert a.deferred_bytes == deferred < a.activations.saved  # so the peak is just after a forward
        assert (a.in_flight, a.deferred) == (b.in_flight, a.stage) == (4 - a.stage, a.stage)
        # DeepSpeed's 1F1B keeps the last stage's two previous losses, whose graphs hold their inputs (bf16,
        # gathered from the tp pieces: N·D·2 bytes each); gpt3d's engine lets go of them
        retained = 2 * N * D * 2 if a.stage == 3 else 0
        assert a.memory["activations"] == b.memory["activations"] - retained
        assert a.memory["deferred_weight_grads"] == a.stage * deferred
        assert a.peak_bytes - b.peak_bytes == a.stage * deferred - retained
        assert a.to_json()["deferred_weight_grad_passes_held"] == a.stage
    assert zb.to_json()["layout"]["schedule"] == ZB_H1 and zb.to_json()["bubble"] == zb.bubble
    # the memory check is ZB-H1's: a device between the two peaks fits 1F1B's and not ZB-H1's
    between = dataclasses.replace(H100, memory_gib=(zb.peak_memory_gib + one_f.peak_memory_gib) / 2)
    assert zb.peak_memory_gib > one_f.peak_memory_gib
    assert build_plan(CFG, ONE_F, between, implementation=BF16).fits
    assert not build_plan(CFG, ZB, between, implementation=BF16).fits


@pytest.mark.parametrize("p, m", [(4, 8), (4, 4), (8, 3), (3, 7)])
@pytest.mark.parametrize("saved, deferred", [(10, 6), (10, 10), (10, 17)])
def test_held_at_peak_is_the_engines_order_at_its_peak(p, m, saved, deferred):
    """Walking each stage's program as the engine runs it: micro batches between their forward and B hold
    `saved` bytes, between B and W `deferred`; the largest total is what held_at_peak's counts give, also
    where a W pass holds more than a micro batch's activations."""
    for stage in range(p):
        peak = _walk_peak(program_passes(ZB_H1, Placement(p), m, stage), {stage: (saved, deferred)})
        in_flight, held = held_at_peak(ZB_H1, p, m, stage, saved, deferred)
        assert in_flight * saved + held * deferred == peak, stage
    assert [held_at_peak(ONE_F_ONE_B, p, m, s, saved, deferred) for s in range(p)] == [(min(p - s, m), 0) for s in range(p)]


def _walk_peak(passes, sizes: dict) -> int:
    """The largest sum over a program of {stage: (saved, deferred)} bytes held: saved from a forward to its
    B, deferred from a B to its W."""
    held, peak = {}, 0
    for kind, v, buffer in passes:
        saved, deferred = sizes[v]
        if kind == "F":
            held[("F", v, buffer)] = saved
        elif kind == "B":
            del held[("F", v, buffer)]
            if deferred:
                held[("B", v, buffer)] = deferred
        else:
            held.pop(("B", v, buffer), None)
        peak = max(peak, sum(held.values()))
    return peak


@pytest.mark.parametrize("schedule, chunks, p, m", [(INTERLEAVED, 2, 4, 8), (INTERLEAVED, 3, 2, 6), (ZB_V, 2, 4, 8),
                                                    (ZB_V, 2, 2, 5)])
def test_chunks_held_at_peak_is_the_engines_programs_at_their_peak(schedule, chunks, p, m):
    """Several chunks a rank, each its own sizes (the first and last virtual stages heavier): the planner's
    peak is the walk of the rank's program."""
    placement = placement_of(schedule, p, chunks)
    split = schedule == ZB_V
    sizes = {v: (10 + 7 * (v == 0) + 13 * (v == placement.stages - 1), 6 if split else 0) for v in range(placement.stages)}
    for rank in range(p):
        (activations, copies), w_bytes, _, _ = chunks_held_at_peak(
            schedule, placement, m, rank, {v: (sizes[v][0], 1) for v in placement.stages_of(rank)},
            {v: sizes[v][1] for v in placement.stages_of(rank)} if split else {})
        walked = _walk_peak(program_passes(schedule, placement, m, rank),
                            {v: (sizes[v][0] + 1, sizes[v][1]) for v in placement.stages_of(rank)})
        assert activations + copies + w_bytes == walked, rank


def test_the_search_ranks_every_schedule_of_every_pipelined_layout():
    """At every pipelined layout: 1F1B, ZB-H1 and the interleaved schedule at each V that divides the blocks a
    rank holds (8 blocks: pp=2 holds 4, V ∈ {2, 4}; pp=4 holds 2, V = 2) where the micro batches divide into
    groups of pp; compiled blocks change nothing (every schedule compiles)."""
    candidates = candidate_layouts(CFG, 8, 16, 8)
    pipelined = {dataclasses.replace(c, schedule=ONE_F_ONE_B, virtual_stages=1) for c in candidates if c.pp > 1}
    for schedule, chunks in ((ONE_F_ONE_B, 1), (ZB_H1, 1), (INTERLEAVED, 2), (INTERLEAVED, 4)):
        expected = {dataclasses.replace(c, schedule=schedule, virtual_stages=chunks) for c in pipelined
                    if chunks == 1 or ((CFG.n_layer // c.pp) % chunks == 0 and c.micro_batches % c.pp == 0)}
        assert expected == {c for c in candidates if c.pp > 1 and (c.schedule, c.virtual_stages) == (schedule, chunks)}
    assert any(c.schedule == INTERLEAVED and c.virtual_stages == 4 for c in candidates)
    assert all(c.schedule == ONE_F_ONE_B for c in candidates if c.pp == 1)
    compiled = dataclasses.replace(CFG, compile=True)
    assert set(candidate_layouts(compiled, 8, 16, 8)) == set(candidates)
    assert "needs parallel.pp > 1" in layout_problem(CFG, Layout(2, 1, 4, 16, 2, schedule=ZB_H1))
    assert "must be one of ['1f1b', 'zb-h1', 'interleaved', 'zb-v']" in layout_problem(
        CFG, dataclasses.replace(ZB, schedule="dualpipe"))
    assert "groups of pp=4: 6 a step" in layout_problem(
        CFG, dataclasses.replace(ZB, schedule=INTERLEAVED, virtual_stages=2, global_batch=12))
    assert "16 virtual pipeline stages" in layout_problem(CFG, dataclasses.replace(ZB, schedule=INTERLEAVED, virtual_stages=4))


def test_the_search_balances_the_stages_where_the_head_weighs_blocks():
    """GPT-3 1.3B on 16 GPUs, batch 32: its head (the 50,257-row unembedding and the loss, about two blocks'
    worth) makes the rank holding the last virtual stage the slowest at an even split; the search's fastest
    layout moves blocks off that rank (parallel.stage_layers), which the rank totals of the plan's own
    per-stage figures confirm, and beats the same layout split by count, ZB-H1 and 1F1B."""
    model = GPTConfig(name="1.3b", n_layer=24, n_head=16, d_model=2048, seq_len=2048)
    plans = search(model, 16, 32, H100, gpus_per_node=8, reserved_gib=2)
    best = plans[0]
    assert best.layout.describe() == "tp=1 pp=4 dp=4 zero=1 micro=2 ckpt=off interleaved V=3 stages=2,3,2,1,2,2,2,2,2,2,2,2"
    even = build_plan(model, dataclasses.replace(best.layout, stage_layers=None), H100, reserved_gib=2)
    placement = best.layout.placement

    def rank_totals(plan):
        return [sum(plan.stage_seconds[v] for v in placement.stages_of(r)) for r in range(4)]

    head_rank = placement.rank_of(placement.stages - 1)
    assert max(rank_totals(even)) == rank_totals(even)[head_rank]  # the head's rank is the slowest, evenly split
    assert max(rank_totals(best)) < max(rank_totals(even))
    assert sum(best.layout.stage_layers[v] for v in placement.stages_of(head_rank)) == 5  # of 24 over 4 ranks
    assert best.tokens_per_s / even.tokens_per_s > 1.1
    for schedule in (ZB_H1, ONE_F_ONE_B):
        assert best.tokens_per_s > next(p for p in plans if p.layout.schedule == schedule).tokens_per_s
    assert "interleaved V=3 stages=2,3,2,1" in format_search(plans, 1).splitlines()[1]
    assert "stage split: blocks [2, 3, 2, 1, 2, 2, 2, 2, 2, 2, 2, 2] (parallel.stage_layers)" in format_plan(best)


def _recipe_175b(*overrides: str):
    """The plan `python -m train.plan +recipe=gpt3-175b-h100x1024 plan.gpus=1024 ...` prints."""
    from train.plan import load
    from train.planner.from_config import plan_from_config

    sections, plan_cfg, model_cfg = load(["+recipe=gpt3-175b-h100x1024", "plan.gpus=1024", *overrides])
    return plan_from_config(sections, plan_cfg, model_cfg)


def test_the_175b_recipe_is_the_fastest_layout_with_4_gib_to_spare():
    """The search over every schedule (docs/planner.md, "GPT-3 175B on 1,024 H100s"), with the block linears'
    collectives in ring steps (parallel.tp_comm_overlap) and each chunk's gradients reduced after its last B: its
    fastest layout interleaves 12 chunks of one block on 8 ranks without recomputation, 59.2% MFU at 76.1 GiB, 1.5
    GiB short of 80 with pre-flight's 2 GiB reserve; the recipe, the fastest that leaves 4 GiB more, is the same
    with selective recomputation: 59.0% with a bubble of 1.7% of the step. Its schedule beside the others at that
    layout: V=6 57.8%, 1F1B 45.4% (a 17.0% bubble), ZB-H1 and ZB-V over the memory (97.6 and 104.0 GiB); without
    the ring overlap 52.1%. model.compile=true changes no bf16 figure."""
    plan = _recipe_175b()
    assert plan.layout.describe() == "tp=8 pp=8 dp=16 zero=1 micro=3 ckpt=selective sp interleaved V=12"
    assert plan.implementation.compiled and plan.fits
    assert plan.predicted_mfu == pytest.approx(0.590, abs=5e-4)
    assert plan.pipeline.bubble_s / plan.step_time_s == pytest.approx(0.017, abs=5e-4)
    # the interleaved bubble: (p − 1)/V of the slowest rank's micro batch, worth 7/12 of one
    assert plan.pipeline.bubble_s == pytest.approx(7 / 12 * plan.pipeline.passes.total, rel=1e-9)
    plans = search(plan.model, 1024, 1536, plan.hardware, gpus_per_node=8, reserved_gib=2,
                   implementation=plan.implementation)
    assert plans[0].layout.describe() == "tp=8 pp=8 dp=16 zero=1 micro=3 ckpt=off sp interleaved V=12"
    assert plans[0].predicted_mfu == pytest.approx(0.592, abs=5e-4)
    roomy = next(p for p in plans if p.hardware.memory_gib - 2 - p.peak_memory_gib >= 4)
    assert roomy.layout == plan.layout
    eager = _recipe_175b("model.compile=false")
    assert eager.step_time_s == plan.step_time_s and not eager.implementation.compiled
    others = {"V=6": _recipe_175b("parallel.virtual_stages=6"),
              "1f1b": _recipe_175b("parallel.pipeline_schedule=1f1b", "parallel.virtual_stages=1"),
              "zb-h1": _recipe_175b("parallel.pipeline_schedule=zb-h1", "parallel.virtual_stages=1"),
              "zb-v": _recipe_175b("parallel.pipeline_schedule=zb-v", "parallel.virtual_stages=1")}
    assert others["V=6"].predicted_mfu == pytest.approx(0.578, abs=5e-4) and others["V=6"].fits
    assert others["1f1b"].predicted_mfu == pytest.approx(0.454, abs=5e-4)
    assert _recipe_175b("parallel.tp_comm_overlap=false").predicted_mfu == pytest.approx(0.521, abs=5e-4)
    assert not others["zb-h1"].fits and not others["zb-v"].fits
    assert all(o.predicted_mfu < plan.predicted_mfu for o in others.values())


def test_chunk_reductions_hide_every_chunks_reduction_but_the_first_and_the_tied_embedding():
    """Interleaved, pp = 2, V = 2, dp = 2, bf16 (BF16_Optimizer): gpt3d's engine reduces each chunk's gradients after
    its last B (parallel/schedules/grad_reduction.py), so on each rank only the chunk that finishes last (its virtual
    stage of lowest index) and the tied embedding's gradient are reduced at the step's end: the data-parallel time
    falls by the all-reduce of the other chunk's gradients, bf16 (2 bytes an element), wte left out (its bytes; the
    planner counts the step's end as one call). Nothing changes
    where the engine reduces at the end: W split off (zb-h1), autocast (DeepSpeed's ZeRO optimizer), one chunk,
    dp = 1, parallel.overlap_communication=false."""
    from train.planner.comm import Transfer
    from train.planner.counts import rank_parameters
    from train.planner.estimate import _comm_time

    layout = Layout(1, 2, 2, 32, 2, 1, schedule=INTERLEAVED, virtual_stages=2)
    off = dataclasses.replace(BF16, chunked_grad_reduction=False)
    on_plan, off_plan = build_plan(CFG, layout, H100, implementation=BF16), build_plan(CFG, layout, H100, implementation=off)
    for rank, on, plain in zip((0, 1), on_plan.ranks, off_plan.ranks):
        early = rank_parameters(CFG, 1, 4, rank + 2)  # virtual stage rank + 2 finishes its backward first
        nbytes = 2 * sum(p.numel for p in early if not p.name.endswith("wte.weight"))
        hidden = _comm_time([Transfer("dp", "all_reduce", "step", nbytes, 1, 2, "gradients")], H100, {"dp": False})
        hidden -= COLLECTIVE_LATENCY_S  # the end keeps a call of its own: the early call's latency is hidden
        assert plain.time["dp_comm_s"] - on.time["dp_comm_s"] == pytest.approx(hidden, rel=1e-9), rank
    said = "data-parallel gradients reduced chunk by chunk behind the backward"  # the plan's overlap line
    assert said in format_plan(on_plan) and said not in format_plan(off_plan)
    for changed, implementation in ((dict(schedule=ZB_H1, virtual_stages=1), BF16), (dict(virtual_stages=1), BF16),
                                    (dict(dp=1, global_batch=16), BF16), ({}, AUTOCAST),
                                    ({}, for_precision("bf16", overlap_communication=False))):
        other = dataclasses.replace(layout, **changed)
        a = build_plan(CFG, other, H100, implementation=implementation)
        b = build_plan(CFG, other, H100, implementation=dataclasses.replace(implementation, chunked_grad_reduction=False))
        assert a.step_time_s == b.step_time_s, changed


def test_a_chunk_reduction_longer_than_its_window_delays_the_backward():
    """The exposed part of a rank's chunk reductions (chunks V − 1 … 1 reduced as each finishes, a window apart):
    with no window nothing hides (each waits for the one before: all of it exposed, one chunk at a time), with an
    ample one only the rest (chunk 0's and the tied embedding's) is."""
    from train.planner.comm import Transfer
    from train.planner.estimate import _comm_time, _exposed_chunk_reductions

    def seconds(nbytes):
        return _comm_time([Transfer("dp", "all_reduce", "step", nbytes, 1, 8, "gradients")], H100, {"dp": True})

    early, total = [3e8, 2e8, 1e8], 7e8  # chunk 0 (reduced at the end), 1, 2; 1e8 bytes of tied embedding
    exposed = _exposed_chunk_reductions(early, total, 0.0, 8, H100, {"dp": True})
    assert exposed == pytest.approx(seconds(1e8) + seconds(2e8) + seconds(4e8), rel=1e-12)
    assert _exposed_chunk_reductions(early, total, 10.0, 8, H100, {"dp": True}) == pytest.approx(seconds(4e8), rel=1e-12)
    window = seconds(1e8) / 2  # chunk 2's reduction runs half a window past chunk 1's issue: chunk 1 waits for it
    expected = (seconds(1e8) - window) + max(0.0, seconds(1e8) + seconds(2e8) - 2 * window - (seconds(1e8) - window))
    assert _exposed_chunk_reductions(early, total, window, 8, H100, {"dp": True}) == pytest.approx(
        expected + seconds(4e8), rel=1e-12)
