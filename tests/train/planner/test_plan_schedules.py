"""Pipeline schedules in the planner (parallel.pipeline_schedule): 1F1B and ZB-H1, each against an
independent reference.

The step of the pipeline against Qi et al.'s formula worked out by hand and against the schedule's own
code (parallel/zero_bubble.py: the order ZeroBubbleEngine runs, timed by `timeline`, and
`predicted_bubble`); the exposed tensor-parallel time against the all-reduce's bytes over the link; the
memory against the linears' shapes and a walk over the engine's order; the search against its
candidates; the 175B recipe's best layout at the figure docs/planner.md states.
"""

from __future__ import annotations

import dataclasses

import pytest

from model import GPTConfig
from parallel.zero_bubble import FORWARD, INPUT_GRAD, Costs, one_f_one_b, predicted_bubble, stage_orders, timeline
from train.config.sections.parallel import ONE_F_ONE_B, ZB_H1
from train.planner.counts import stage_blocks
from train.planner.estimate import (
    COLLECTIVE_LATENCY_S,
    Layout,
    Passes,
    _per_weight_bytes,
    build_plan,
    deferred_parameters_per_block,
    for_precision,
    held_at_peak,
    pipeline_seconds,
)
from train.planner.hardware import preset
from train.planner.search import candidate_layouts, layout_problem, search
from train.planner.tables import format_plan, format_search

H100 = preset("h100-80g")
CFG = GPTConfig(name="6.7b-8", n_layer=8, n_head=32, d_model=4096, seq_len=2048)  # GEMM-bound, not host-bound
N, D, F = 2 * 2048, 4096, 4 * 4096  # tokens of a micro batch, d_model, d_ff
BF16, AUTOCAST = for_precision("bf16"), for_precision("autocast")
ZB = Layout(2, 4, 1, 16, 2, schedule=ZB_H1)  # m = 8 micro batches of 2 through 4 stages of 2 blocks, tp = 2
ONE_F = dataclasses.replace(ZB, schedule=ONE_F_ONE_B)


def _engine_step(orders, costs: Costs) -> float:
    return max(stage[-1][3] for stage in timeline(orders, costs))


def test_zb_h1_bubble_is_the_papers_and_the_schedules_own():
    """Under autocast (no BF16_Optimizer pass in W, so W ≤ min(F, B) here)."""
    plan = build_plan(CFG, ZB, H100, implementation=AUTOCAST)
    baseline = build_plan(CFG, ONE_F, H100, implementation=AUTOCAST)
    p, m = 4, 8
    f, b, w = dataclasses.astuple(plan.pipeline.passes)
    assert w <= min(f, b)  # where Qi et al.'s form holds
    by_hand = (p - 1) * (f + b - w) / (m * (f + b + w) + (p - 1) * (f + b - w))
    assert plan.bubble == pytest.approx(by_hand, rel=1e-12)
    assert plan.bubble == pytest.approx(predicted_bubble(ZB_H1, p, m, Costs(f, b, w)), rel=1e-9)
    slowest = plan.pipeline.slowest
    dp_and_optimizer = max(r.time["dp_comm_s"] + r.time["optimizer_s"] for r in plan.ranks)
    assert plan.step_time_s == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w) + dp_and_optimizer, rel=1e-12)
    assert f + b + w == pytest.approx(slowest.time["micro_batch_s"], rel=1e-12)
    # 1F1B: (p − 1)/(m + p − 1), the schedule's own timeline with B and W as one backward
    assert baseline.bubble == pytest.approx(3 / 11, rel=1e-12)
    baseline_costs = Costs(*dataclasses.astuple(baseline.pipeline.passes))
    assert baseline.bubble == pytest.approx(predicted_bubble(ONE_F_ONE_B, p, m, baseline_costs), rel=1e-9)
    assert plan.bubble < baseline.bubble


@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 1.4, 0.7), (0.8, 2.0, 0.9), (2.0, 0.5, 1.0),
                                   (1.0, 0.5, 3.0), (1.0, 2.0, 0.0)],
                         ids=["equal", "w-smallest", "w-above-f", "w-above-b", "w-largest", "no-w"])
def test_pipeline_seconds_is_the_engines_order_timed_at_any_m_and_costs(costs):
    """The closed forms against parallel.zero_bubble.timeline of the order ZeroBubbleEngine runs
    (stage_orders with equal costs), for fewer micro batches than stages too; 1F1B against its timeline."""
    f, b, w = costs
    for p in (2, 3, 4, 8):
        for m in range(1, 3 * p + 1):
            engine = _engine_step(stage_orders(p, m), Costs(f, b, w))
            assert pipeline_seconds(ZB_H1, p, m, Passes(f, b, w)) == pytest.approx(engine, rel=1e-12), (p, m)
            one_f = _engine_step([one_f_one_b(p, m, s) for s in range(p)], Costs(f, b + w, 0.0))
            assert pipeline_seconds(ONE_F_ONE_B, p, m, Passes(f, b, w)) == pytest.approx(one_f, rel=1e-12), (p, m)


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
    (BF16_OPTIMIZER_UPDATE_BYTES, 18 bytes a parameter) after being cleared and accumulated
    (_per_weight_bytes); under ZB-H1 the parameters W computes (the four linears' weights, the column layers'
    biases) get fresh gradients in W, added there: 18 bytes in W, and 18 + _per_weight_bytes fewer in B.
    Without BF16_Optimizer (autocast) the schedules' per-parameter traffic is the same."""
    tp = 2
    per_block = (3 * D * D + D * D + F * D + D * F + 3 * D + F) // tp  # counted here from the shapes
    for implementation, bf16_optimizer in ((BF16, True), (AUTOCAST, False)):
        zb = build_plan(CFG, ZB, H100, implementation=implementation).ranks
        one_f = build_plan(CFG, ONE_F, H100, implementation=implementation).ranks
        for a, b in zip(zb, one_f):
            deferred = len(stage_blocks(CFG.n_layer, 4, a.stage)) * per_block
            w_extra = deferred * 18 / H100.memory_bandwidth if bf16_optimizer else 0.0
            saved = deferred * _per_weight_bytes(BF16) / H100.memory_bandwidth if bf16_optimizer else 0.0
            assert a.time["weight_grad_s"] - b.time["weight_grad_s"] == pytest.approx(w_extra, rel=1e-9, abs=1e-15)
            assert b.time["compute_s"] - a.time["compute_s"] == pytest.approx(saved, rel=1e-9, abs=1e-15)
    tp, blocks = 2, 2
    products = sum(2 * N * k * m / H100.flops for k, m in ((D, 3 * D // tp), (D // tp, D), (D, F // tp), (F // tp, D)))
    bias_sums = 2 * N * (3 * D + F) / tp / H100.memory_bandwidth  # read g of attn.qkv and mlp.fc, bf16
    middle = build_plan(CFG, ONE_F, H100, implementation=BF16).ranks[1]
    assert middle.time["weight_grad_s"] == pytest.approx(blocks * (products + bias_sums), rel=1e-9)


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
        assert a.memory["activations"] == b.memory["activations"]
        assert a.memory["deferred_weight_grads"] == a.stage * deferred
        assert a.peak_bytes - b.peak_bytes == a.stage * deferred
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
    """Walking each stage's order (parallel.zero_bubble.stage_orders, as the engine runs it): micro batches
    between their forward and B hold `saved` bytes, between B and W `deferred`; the largest total is
    what held_at_peak's counts give, also where a W pass holds more than a micro batch's activations."""
    layout = Layout(1, p, 1, m, 1, schedule=ZB_H1)
    for stage, order in enumerate(stage_orders(p, m)):
        forwards = input_grads = weight_grads = peak = 0
        for kind, _ in order:
            forwards += kind == FORWARD
            input_grads += kind == INPUT_GRAD
            weight_grads += kind not in (FORWARD, INPUT_GRAD)
            peak = max(peak, (forwards - input_grads) * saved + (input_grads - weight_grads) * deferred)
        in_flight, held = held_at_peak(layout, stage, saved, deferred)
        assert in_flight * saved + held * deferred == peak, stage
    one_f = dataclasses.replace(layout, schedule=ONE_F_ONE_B)
    assert [held_at_peak(one_f, s, saved, deferred) for s in range(p)] == [(min(p - s, m), 0) for s in range(p)]


def test_the_search_ranks_both_schedules_of_every_pipelined_layout():
    candidates = candidate_layouts(CFG, 8, 16, 8)
    for schedule in (ONE_F_ONE_B, ZB_H1):
        assert {dataclasses.replace(c, schedule=schedule) for c in candidates if c.pp > 1} == \
            {c for c in candidates if c.pp > 1 and c.schedule == schedule}
    assert all(c.schedule == ONE_F_ONE_B for c in candidates if c.pp == 1)
    compiled = dataclasses.replace(CFG, compile=True)
    assert all(c.schedule == ONE_F_ONE_B for c in candidate_layouts(compiled, 8, 16, 8))
    assert "needs parallel.pp > 1" in layout_problem(CFG, Layout(2, 1, 4, 16, 2, schedule=ZB_H1))
    assert "model.compile=true" in layout_problem(compiled, ZB)
    assert "must be one of ['1f1b', 'zb-h1']" in layout_problem(CFG, dataclasses.replace(ZB, schedule="zb-v"))


def test_the_search_takes_zb_h1_where_it_is_faster_and_says_so():
    """GPT-3 1.3B on 16 GPUs, batch 32, under the default implementation (autocast: no BF16_Optimizer pass
    in W): 2 micro batches through 2 stages, where ZB-H1's bubble is far smaller than 1F1B's."""
    model = GPTConfig(name="1.3b", n_layer=24, n_head=16, d_model=2048, seq_len=2048)
    plans = search(model, 16, 32, H100, gpus_per_node=8, reserved_gib=2)
    best, best_1f1b = plans[0], next(p for p in plans if not p.layout.zero_bubble)
    assert best.layout.describe() == "tp=1 pp=2 dp=8 zero=1 micro=2 ckpt=off zb-h1"
    same_layout = build_plan(model, dataclasses.replace(best.layout, schedule=ONE_F_ONE_B), H100, reserved_gib=2)
    assert best.tokens_per_s > best_1f1b.tokens_per_s >= same_layout.tokens_per_s
    assert "zb-h1" in format_search(plans, 1).splitlines()[1]
    assert "and the ZB-H1 bubble, worth" in format_plan(best)


def _recipe_175b(*overrides: str):
    """The plan `python -m train.plan +recipe=gpt3-175b-h100x1024 plan.gpus=1024 ...` prints."""
    from train.plan import load
    from train.planner.from_config import plan_from_config

    sections, plan_cfg, model_cfg = load(["+recipe=gpt3-175b-h100x1024", "plan.gpus=1024", *overrides])
    return plan_from_config(sections, plan_cfg, model_cfg)


def test_the_175b_recipes_best_layout_with_zb_h1_allowed():
    """The search over both schedules (docs/planner.md, "GPT-3 175B on 1,024 H100s"): the recipe's layout,
    ZB-H1 with sequence parallelism, is first at 43.8% MFU. The fastest 1F1B layout is tp=8 pp=1 dp=128
    with ZeRO-2 (no pipeline, and no BF16_Optimizer: nothing of its per-micro-batch update) at 40.5%. At the
    recipe's layout 1F1B predicts 38.0%: a bubble of 1.145 s a step against ZB-H1's 0.407 s, and a micro
    batch longer by the clearing and accumulation of the bf16 gradients that ZB-H1's W makes fresh
    (10 bytes a parameter, 1.36B parameters a stage: 4.51 ms). Both schedules add each gradient to its
    fp32 copy once per micro batch (BF16_OPTIMIZER_UPDATE_BYTES, in the compute of both; before, the plan
    counted it under neither, only a second update in ZB-H1's W, which the engine no longer runs, and so
    predicted 43.5% for 1F1B at this layout without sequence parallelism, now 38.7%). With sequence
    parallelism the plan counts the tensor-parallel collectives whole under both schedules; without it
    ZB-H1 loses 1F1B's overlap of the column layers' input-gradient all-reduces (6.05 ms a micro batch)
    and still wins, 41.1% against 38.7%."""
    plan = _recipe_175b()
    assert plan.layout.describe() == "tp=8 pp=16 dp=8 zero=1 micro=2 ckpt=off sp zb-h1"
    plans = search(plan.model, 1024, 1536, plan.hardware, gpus_per_node=8, reserved_gib=2,
                   implementation=plan.implementation)
    assert plans[0].layout == plan.layout and plans[0].predicted_mfu == pytest.approx(0.438, abs=5e-4)
    assert plan.predicted_mfu == pytest.approx(0.438, abs=5e-4) and plan.fits
    best_1f1b = next(p for p in plans if not p.layout.zero_bubble)
    assert best_1f1b.layout.describe() == "tp=8 pp=1 dp=128 zero=2 micro=12 ckpt=1 sp"
    assert best_1f1b.predicted_mfu == pytest.approx(0.405, abs=5e-4)
    one = _recipe_175b("parallel.pipeline_schedule=1f1b")  # the config's schedule is the plan's
    assert one.layout == dataclasses.replace(plan.layout, schedule=ONE_F_ONE_B)
    assert one.predicted_mfu == pytest.approx(0.380, abs=5e-4) and one.fits
    assert plan.pipeline.bubble_s == pytest.approx(0.407, abs=5e-4) and one.pipeline.bubble_s == pytest.approx(1.145, abs=5e-4)
    deferred = 6 * deferred_parameters_per_block(plan.model, 8)  # W's parameters on a stage of 6 blocks
    fresh = deferred * _per_weight_bytes(plan.implementation) / plan.hardware.memory_bandwidth
    assert fresh == pytest.approx(4.51e-3, abs=5e-5)
    for zb_rank, one_rank in zip(plan.ranks, one.ranks):
        assert zb_rank.time["tp_comm_s"] == one_rank.time["tp_comm_s"]
        assert one_rank.time["micro_batch_s"] - zb_rank.time["micro_batch_s"] == pytest.approx(fresh, rel=1e-9)
    zb = _recipe_175b("parallel.sequence_parallel=false")
    one = _recipe_175b("parallel.sequence_parallel=false", "parallel.pipeline_schedule=1f1b")
    assert zb.predicted_mfu == pytest.approx(0.411, abs=5e-4) and one.predicted_mfu == pytest.approx(0.387, abs=5e-4)
    assert zb.ranks[0].time["tp_comm_s"] - one.ranks[0].time["tp_comm_s"] == pytest.approx(6.05e-3, abs=5e-5)
