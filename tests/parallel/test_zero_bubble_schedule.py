"""The ZB-H1 schedule (parallel/zero_bubble.py): its orders, its timeline and each stage's program.

The references are the zero-bubble paper's closed forms and 1F1B's, computed here by hand:

    1F1B    step = (m + p − 1)·(t_F + t_B + t_W)
    ZB-H1   step = m·(t_F + t_B + t_W) + (p − 1)·(t_F + t_B − t_W)
"""

from __future__ import annotations

import itertools

import pytest

from parallel.zero_bubble import (
    Costs,
    Forward,
    InputGradPass,
    PostRecvActivation,
    PostRecvGrad,
    SendActivationAsync,
    SendGradAsync,
    WeightGradPass,
    one_f_one_b,
    predicted_bubble,
    stage_orders,
    stage_program,
    timeline,
)

COSTS = [Costs(1, 1, 1), Costs(1, 1, 0.5), Costs(2, 1, 1), Costs(1, 1.3, 0.7)]
GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("stages, micro_batches", GRID)
def test_zb_h1_reaches_the_papers_step_time(stages, micro_batches, costs):
    f, b, w = costs.forward, costs.input_grad, costs.weight_grad
    passes = timeline(stage_orders(stages, micro_batches, costs), costs)
    step = max(stage[-1][3] for stage in passes)
    assert step == pytest.approx(micro_batches * (f + b + w) + (stages - 1) * (f + b - w))


@pytest.mark.parametrize("stages, micro_batches", GRID)
def test_bubbles_against_the_closed_forms(stages, micro_batches):
    p, m = stages, micro_batches
    assert predicted_bubble("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert predicted_bubble("zb-h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.parametrize("stages, micro_batches", GRID)
def test_each_stage_runs_every_pass_once_in_order_and_holds_at_most_1f1bs_memory(stages, micro_batches):
    for s, order in enumerate(stage_orders(stages, micro_batches)):
        for kind in "FBW":
            assert [j for k, j in order if k == kind] == list(range(micro_batches)), (s, kind)
        assert [x for x in order if x[0] != "W"] == one_f_one_b(stages, micro_batches, s)  # F and B as 1F1B
        held = deferred = 0
        for kind, j in order:
            held += kind == "F"
            held -= kind == "B"
            deferred += {"B": 1, "W": -1}.get(kind, 0)
            assert held <= stages - s  # activations of forwards whose B has not run: 1F1B's bound
            assert deferred <= s + 1  # W work held (s + 1 only between a B and the W it forces)
        # a W waits for its own B
        assert all(order.index(("B", j)) < order.index(("W", j)) for j in range(micro_batches))


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_both_ends_of_every_link_issue_its_messages_in_one_order(stages, micro_batches):
    """What stage s sends to s + 1 (activations) and receives from it (gradients), in issue order, is
    what s + 1 receives and sends: NCCL pairs point-to-point operations by their order."""
    programs = [stage_program(stages, micro_batches, s) for s in range(stages)]
    for s in range(stages - 1):
        upper = [("act" if isinstance(i, SendActivationAsync) else "grad", i.buffer_id) for i in programs[s]
                 if isinstance(i, (SendActivationAsync, PostRecvGrad))]
        lower = [("act" if isinstance(i, PostRecvActivation) else "grad", i.buffer_id) for i in programs[s + 1]
                 if isinstance(i, (PostRecvActivation, SendGradAsync))]
        assert upper == lower and len(upper) == 2 * micro_batches, s
        for program, receive, uses in ((programs[s], PostRecvGrad, InputGradPass),
                                       (programs[s + 1], PostRecvActivation, Forward)):
            for j in range(micro_batches):  # every receive is posted before the pass that waits on it
                posted = next(n for n, i in enumerate(program) if isinstance(i, receive) and i.buffer_id == j)
                used = next(n for n, i in enumerate(program) if isinstance(i, uses) and i.buffer_id == j)
                assert posted < used


def test_the_last_stage_runs_each_b_right_after_its_forward():
    for stages, micro_batches in itertools.product((2, 4), (4, 8)):
        order = [x for x in stage_orders(stages, micro_batches)[-1] if x[0] != "W"]
        assert order == [(k, j) for j in range(micro_batches) for k in "FB"]
        assert sum(isinstance(i, WeightGradPass) for i in stage_program(stages, micro_batches, stages - 1)) == micro_batches
