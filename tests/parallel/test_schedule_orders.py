"""The pipeline schedules (parallel/schedules/): their orders, the timelines they predict and each rank's program.

The references are closed forms computed here by hand (Qi et al. for ZB-H1, Narayanan et al. for the
interleaved schedule), with p ranks, m micro batches, V chunks a rank and t_F, t_B, t_W a chunk's passes:

    1F1B         step = (m + p − 1)·(t_F + t_B + t_W)
    ZB-H1        step = m·(t_F + t_B + t_W) + (p − 1)·(t_F + t_B − t_W)
    interleaved  step = (V·m + p − 1)·(t_F + t_B + t_W)
    any          step ≥ (p − 1)·t_F + V·m·(t_F + t_B + t_W): the last rank's first input comes after p − 1 forwards
"""

from __future__ import annotations

import itertools

import pytest

from parallel.schedules.orders import (
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Costs,
    dependency,
    forward_orders,
    one_f_one_b,
    placement_of,
    predicted_bubble,
    rank_orders,
    schedule_costs,
    timeline,
    zb_h1,
)
from parallel.schedules.placement import Placement
from parallel.schedules.program import (
    Forward,
    HandOffActivation,
    HandOffGrad,
    InputGradPass,
    PostRecvActivation,
    PostRecvGrad,
    SendActivationAsync,
    SendGradAsync,
    WeightGradPass,
    rank_program,
)

COSTS = [Costs(1, 1, 1), Costs(1, 1, 0.5), Costs(2, 1, 1), Costs(1, 1.3, 0.7)]
GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
# (schedule, V): every schedule gpt3d runs itself, interleaved at 2 and 3 chunks
OWN = [("zb-h1", 1), ("interleaved", 2), ("interleaved", 3), ("zb-v", 2)]


def step_of(schedule: str, placement: Placement, m: int, costs: Costs) -> float:
    passes = timeline(rank_orders(schedule, placement, m, costs), schedule_costs(schedule, costs))
    return max(rank[-1][4] for rank in passes)


@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("stages, micro_batches", GRID)
def test_zb_h1_reaches_the_papers_step_time(stages, micro_batches, costs):
    f, b, w = costs.forward, costs.input_grad, costs.weight_grad
    step = step_of("zb-h1", Placement(stages), micro_batches, costs)
    assert step == pytest.approx(micro_batches * (f + b + w) + (stages - 1) * (f + b - w))


@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("stages, micro_batches", GRID)
def test_interleaved_reaches_its_closed_form_and_zb_v_the_lower_bound(stages, micro_batches, chunks, costs):
    f, b, w = costs.forward, costs.input_grad, costs.weight_grad
    p, m = stages, micro_batches
    assert step_of("interleaved", Placement(p, chunks), m, costs) == pytest.approx((chunks * m + p - 1) * (f + b + w))
    zb_v, bound = step_of("zb-v", placement_of("zb-v", p), m, costs), (p - 1) * f + 2 * m * (f + b + w)
    assert zb_v >= bound - 1e-9
    if costs == Costs():  # equal passes: no schedule can do better, and zb-v does not do worse
        assert zb_v == pytest.approx(bound)


@pytest.mark.parametrize("stages, micro_batches", GRID)
def test_bubbles_against_the_closed_forms(stages, micro_batches):
    p, m = stages, micro_batches
    assert predicted_bubble("1f1b", Placement(p), m) == pytest.approx((p - 1) / (m + p - 1))
    assert predicted_bubble("zb-h1", Placement(p), m) == pytest.approx((p - 1) / (3 * m + p - 1))
    for chunks in (2, 3):
        assert predicted_bubble("interleaved", Placement(p, chunks), m) == pytest.approx((p - 1) / (chunks * m + p - 1))
    assert predicted_bubble("zb-v", placement_of("zb-v", p), m) == pytest.approx((p - 1) / (6 * m + p - 1))


def held_at_peak(order, kinds=(FORWARD, INPUT_GRAD)) -> tuple[int, int]:
    """(activations of forwards whose B has not run, B's whose W has not run), each at its peak over `order`."""
    held = deferred = peak_held = peak_deferred = 0
    for kind, _, _ in order:
        held += {FORWARD: 1, INPUT_GRAD: -1}.get(kind, 0)
        deferred += {INPUT_GRAD: 1, WEIGHT_GRAD: -1}.get(kind, 0)
        peak_held, peak_deferred = max(peak_held, held), max(peak_deferred, deferred)
    return peak_held, peak_deferred


@pytest.mark.parametrize("schedule, chunks", OWN)
@pytest.mark.parametrize("stages, micro_batches", GRID)
def test_each_rank_runs_every_pass_of_its_stages_once_in_order(schedule, chunks, stages, micro_batches):
    placement = placement_of(schedule, stages, chunks)
    orders = rank_orders(schedule, placement, micro_batches)
    kinds = "FBW" if schedule in ("zb-h1", "zb-v") else "FB"
    for rank, order in enumerate(orders):
        assert {k for k, _, _ in order} == set(kinds)
        for v, kind in itertools.product(placement.stages_of(rank), kinds):
            assert [j for k, s, j in order if k == kind and s == v] == list(range(micro_batches)), (rank, v, kind)
        assert {s for _, s, _ in order} == set(placement.stages_of(rank))
        bs = [(s, j) for k, s, j in order if k == INPUT_GRAD]
        assert [(s, j) for k, s, j in order if k == WEIGHT_GRAD] == (bs if "W" in kinds else [])  # W in B's order
    timeline(orders, schedule_costs(schedule, Costs()))  # raises on a deadlock


@pytest.mark.parametrize("stages, micro_batches", GRID)
def test_zb_h1_keeps_1f1bs_order_and_memory(stages, micro_batches):
    for s, order in enumerate(zb_h1(stages, micro_batches)):
        assert [x for x in order if x[0] != WEIGHT_GRAD] == one_f_one_b(stages, micro_batches, s)
        held, deferred = held_at_peak(order)
        assert held <= stages - s  # 1F1B's bound
        assert deferred <= s + 1  # (s + 1 only between a B and the W it forces)


@pytest.mark.parametrize("stages, micro_batches", GRID)
def test_interleaved_and_zb_v_hold_what_their_papers_say(stages, micro_batches):
    """Interleaved: rank s holds at most (p − s − 1)·2 + (V − 1)·p + 1 chunks' activations (Megatron's
    warm-up); zb-v at most 2p chunks, 1F1B's peak of p whole stages, on every rank."""
    p = stages
    for chunks in (2, 3):
        for s, order in enumerate(rank_orders("interleaved", Placement(p, chunks), micro_batches)):
            assert held_at_peak(order)[0] <= min((p - s - 1) * 2 + (chunks - 1) * p + 1, chunks * micro_batches)
    for order in rank_orders("zb-v", placement_of("zb-v", p), micro_batches):
        assert held_at_peak(order)[0] <= 2 * p


def test_placements():
    loop, v = Placement(4, 2), placement_of("zb-v", 4)
    assert [loop.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [v.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.stages_of(0) == (0, 7) and v.chunk_of(7) == 1
    with pytest.raises(ValueError, match="a V placement holds 2 chunks"):
        Placement(2, 3, "v")
    with pytest.raises(ValueError, match="groups of pp=4"):
        rank_orders("interleaved", Placement(4, 2), 6)


def test_dependencies_follow_the_virtual_stages():
    assert dependency(FORWARD, 3, 5, 8) == (FORWARD, 2, 5)
    assert dependency(INPUT_GRAD, 3, 5, 8) == (INPUT_GRAD, 4, 5)
    assert dependency(INPUT_GRAD, 7, 5, 8) == (FORWARD, 7, 5)
    assert dependency(FORWARD, 0, 5, 8) is None


def messages(program, rank: int, placement: Placement) -> dict[int, list]:
    """{peer: [(kind, direction, buffer or stage info)]} in issue order, as the other end should see them."""
    out: dict[int, list] = {}
    for i in program:
        if isinstance(i, (SendActivationAsync, SendGradAsync, PostRecvActivation, PostRecvGrad)):
            kind = "act" if isinstance(i, (SendActivationAsync, PostRecvActivation)) else "grad"
            sending = isinstance(i, (SendActivationAsync, SendGradAsync))
            out.setdefault(i.peer, []).append((kind, sending))
    return out


@pytest.mark.parametrize("schedule, chunks", OWN)
@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_both_ends_of_every_link_issue_its_messages_in_one_order(schedule, chunks, stages, micro_batches):
    """What rank a sends to rank b and receives from it, in issue order, is what b receives and sends:
    NCCL pairs point-to-point operations by their order. Every receive is posted before the pass that
    waits on it, and a rank's own neighbouring stages hand off in memory instead."""
    placement = placement_of(schedule, stages, chunks)
    for training in (True, False):
        programs = [rank_program(schedule, placement, micro_batches, r, training=training) for r in range(stages)]
        seen = [messages(program, r, placement) for r, program in enumerate(programs)]
        for a, b in itertools.permutations(range(stages), 2):
            mine = seen[a].get(b, [])
            theirs = [(kind, not sending) for kind, sending in seen[b].get(a, [])]
            assert mine == theirs, (a, b)
        for r, program in enumerate(programs):
            hand_offs = [i for i in program if isinstance(i, (HandOffActivation, HandOffGrad))]
            turns = sum(placement.rank_of(v) == placement.rank_of(v + 1) == r for v in range(placement.stages - 1))
            assert len(hand_offs) == turns * micro_batches * (2 if training else 1)
            for receive, uses in ((PostRecvGrad, InputGradPass), (PostRecvActivation, Forward)):
                for n, i in enumerate(program):
                    if isinstance(i, receive):
                        used = next(k for k, x in enumerate(program) if isinstance(x, uses) and x.buffer_id == i.buffer_id)
                        assert n < used
            if not training:
                assert not any(isinstance(i, (InputGradPass, WeightGradPass)) for i in program)


def test_the_loss_stage_runs_each_b_right_after_its_forward_under_zb_h1():
    for stages, micro_batches in itertools.product((2, 4), (4, 8)):
        order = [x for x in zb_h1(stages, micro_batches)[-1] if x[0] != WEIGHT_GRAD]
        assert order == [(k, stages - 1, j) for j in range(micro_batches) for k in "FB"]
        program = rank_program("zb-h1", Placement(stages), micro_batches, stages - 1)
        assert sum(isinstance(i, WeightGradPass) for i in program) == micro_batches


def test_evaluation_runs_every_forward_once():
    for schedule, chunks in OWN:
        placement = placement_of(schedule, 4, chunks)
        orders = forward_orders(placement, 5)
        assert sorted(x for order in orders for x in order) == sorted(
            (FORWARD, v, j) for v in range(placement.stages) for j in range(5))
