"""The planner's RING_LAUNCHES and RING_WEIGHT_CAST_LAUNCHES (train/planner/estimate.py): the kernels a block linear
under parallel.tp_comm_overlap launches a micro batch beyond the same linear under plain sequence parallelism,
counted by bench/op_ledger.py on the layers themselves (forward and backward, bf16 weights, micro batches of two
sequences) at tp = 2 and 4 on gloo: a + b·p for a column and a row layer, in bf16 and in float8 (torch._scaled_mm,
the fused cast and the scales as on a GPU, one kernel each), inside a training step whose float8 weight casts are
kept (model/float8_weights.py) as the trainer runs it: its second micro batch, and the first's extra launches (the
weight's amax, scale and casts); and at one sequence a micro batch, one launch fewer (RING_COPY_LAUNCHES: the
scattered operand's copy into sequence pieces). Within one launch: the plain row layer's count has been seen to
differ by one between runs."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from train.planner.estimate import RING_COPY_LAUNCHES, RING_LAUNCHES, RING_WEIGHT_CAST_LAUNCHES

IN, OUT, BATCH = 64, 64, 2


def _launches(layer, x) -> int:
    from bench.op_ledger import OpLedger

    ledger = OpLedger()
    with ledger:
        ledger.recording = True
        layer(x).float().sum().backward()
    return sum(op.kernels for op in ledger.ops)


def count_worker(tp: int) -> tuple[dict, dict]:
    from model.float8_weights import WeightCasts
    from model.modes import Float8
    from parallel.tensor import ColumnParallelLinear, RowParallelLinear
    from parallel.topology import Topology

    group, tokens, casts = Topology.create(tp=tp).tp_group, 16 * tp, WeightCasts()
    counts, first, one_sequence = {}, {}, {}
    for fp8 in (False, True):
        mode = Float8(weight_casts=casts) if fp8 else None
        for column in (True, False):
            kind = ColumnParallelLinear if column else RowParallelLinear
            for ring in (False, True):
                layer = kind(IN, OUT, group, sequence_parallel=True, dtype=torch.bfloat16, ring_overlap=ring,
                             fp8=mode if ring else None)  # against the plain bf16 linear of the same place
                torch.nn.init.normal_(layer.weight)
                if column:  # the ring's column layer gathers its piece; the plain one takes the LayerNorm's gather
                    shape = (BATCH, tokens // tp if ring else tokens, IN)
                else:
                    shape = (BATCH, tokens, IN // tp)
                x = torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
                _launches(layer, x)  # a first call's one-time work left out
                with casts.step():
                    first[fp8, column, ring] = _launches(layer, x)
                    counts[fp8, column, ring] = _launches(layer, x)
                if ring:  # one sequence a micro batch: the scattered operand's pieces need no copy
                    x_one = x[:1].detach().requires_grad_()  # (1, T', k), a leaf as x is
                    with casts.step():
                        _launches(layer, x_one)
                        one_sequence[fp8, column] = _launches(layer, x_one)
    added = {key: counts[key + (True,)] - counts[key + (False,)] for key in RING_LAUNCHES}
    copies = {key: counts[key + (True,)] - one_sequence[key] for key in RING_LAUNCHES}
    return added, {key: first[key + (True,)] - counts[key + (True,)] for key in RING_LAUNCHES}, copies


@pytest.mark.parametrize("tp", [2, 4])
def test_ring_launches_are_the_layers_own(tp):
    added, step_first, copies = run_distributed(count_worker, tp, tp)[0]
    for (fp8, column), (a, b) in RING_LAUNCHES.items():
        assert abs(added[fp8, column] - (a + b * tp)) <= 1, ((fp8, column), added[fp8, column], a + b * tp)
        assert step_first[fp8, column] == (RING_WEIGHT_CAST_LAUNCHES if fp8 else 0), ((fp8, column), step_first)
        assert copies[fp8, column] == RING_COPY_LAUNCHES, ((fp8, column), copies)
