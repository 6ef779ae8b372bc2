"""The planner's counts equal what the built system holds and sends (gloo processes on the CPU).

tp=2 × pp=2 × dp=2 (8 processes) with ZeRO 0 and 1, and dp=2 (2 processes) with ZeRO 2 and 3: per
rank, the parameters and the bytes of weights, gradients, fp32 master weights and Adam moments that
DeepSpeed's engine really keeps (tests/helpers/plan_probe.py reads them off its objects) must equal
parallel/plan_counts exactly; and one step's communication must equal parallel/plan_comm: the
tensor-parallel collectives as parallel/comm.py records them, everything DeepSpeed sends as its own
communication logger records it.

The model has odd sizes on purpose (vocabulary 300, padded to 512 at tp=2; at dp=2 d_model 27 with
3 heads), so DeepSpeed's alignment padding and uneven partitions are exercised.
"""

from __future__ import annotations

from functools import partial

import pytest
from distributed import run_distributed
from plan_probe import probe

from model import GPTConfig
from train.planner import comm as plan_comm
from train.planner.activations import StageShape
from train.planner.counts import FP32, rank_parameters, state_bytes
from train.planner.estimate import dp_grad_bytes
from train.planner.layout import for_precision

MODEL_3D = dict(name="probe", n_layer=3, n_head=2, d_model=30, seq_len=16, vocab_size=300)
MODEL_DP = dict(name="probe", n_layer=2, n_head=3, d_model=27, seq_len=16, vocab_size=300)
GLOBAL_BATCH, MICRO_BATCH = 8, 1


def bookkeeping(op: str, size: int) -> bool:
    """DeepSpeed's own messages, not the model's data: the loss broadcast, overflow and norm checks
    (scalar all-reduces) and the shape header sent before each partitioned pipeline tensor."""
    return op == "broadcast" or (op == "all_reduce" and size <= 8) or (op == "send" and size < 128)


@pytest.fixture(scope="module")
def run_3d():
    return run_distributed(probe, 8, MODEL_3D, 2, 2, [0, 1], GLOBAL_BATCH, MICRO_BATCH, timeout=900)


@pytest.fixture(scope="module")
def run_dp():
    return run_distributed(probe, 2, MODEL_DP, 1, 1, [2, 3], GLOBAL_BATCH, MICRO_BATCH, timeout=600)


@pytest.fixture(scope="module")
def run_dp_bf16():
    """dp=2 in bf16 at ZeRO 1: DeepSpeed's bf16 optimizer, as on a GPU."""
    return run_distributed(probe, 2, MODEL_DP, 1, 1, [1], GLOBAL_BATCH, MICRO_BATCH, "bf16", timeout=600)


def _expected_state(model: dict, tp: int, pp: int, dp: int, result: dict):
    stage, dp_rank, _ = result["coords"]
    params = rank_parameters(GPTConfig(**model), tp, pp, stage)
    return params, state_bytes(params, result["zero_stage"], dp, dp_rank, bf16_weights=result["precision"] == "bf16")


def _assert_state(model, tp, pp, dp, results):
    for per_rank in results:
        for result in per_rank:
            params, expected = _expected_state(model, tp, pp, dp, result)
            got, where = result["state"], f"rank {result['coords']} ZeRO-{result['zero_stage']}"
            assert got["parameters"] == sum(p.numel for p in params), where
            for kind in ("weights", "gradients", "master", "moments", "buffers"):
                assert got[kind] == getattr(expected, kind), f"{where}: {kind} {got[kind]} ≠ {getattr(expected, kind)}"


def test_state_bytes_per_rank_are_exact_at_tp2_pp2_dp2_zero0_and_zero1(run_3d):
    _assert_state(MODEL_3D, 2, 2, 2, run_3d)


def test_state_bytes_per_rank_are_exact_at_dp2_zero2_and_zero3(run_dp):
    _assert_state(MODEL_DP, 1, 1, 2, run_dp)


def _sums(items) -> dict:
    out = {}
    for key, nbytes in items:
        out[key] = out.get(key, 0) + nbytes
    return out


def _planned(model: dict, tp: int, pp: int, dp: int, result: dict) -> list:
    cfg, stage = GPTConfig(**model), result["coords"][0]
    shape, zero = StageShape.of(cfg, pp, stage), result["zero_stage"]
    params = rank_parameters(cfg, tp, pp, stage)
    m = GLOBAL_BATCH // (MICRO_BATCH * dp)
    tied = sum(p.numel for p in params if p.name.endswith("wte.weight"))
    impl = for_precision(result["precision"])
    flat = state_bytes(params, zero, dp, bf16_weights=impl.bf16_weights).details.get("flat", 0)
    return (
        plan_comm.tensor_parallel(cfg, shape, tp, MICRO_BATCH, m, autocast=False)
        + plan_comm.pipeline(cfg, shape, tp, pp, MICRO_BATCH, m, tied)
        + plan_comm.data_parallel(params, dp, zero, m, flat_elements=flat, grad_bytes=partial(dp_grad_bytes, impl, zero),
                                  weight_bytes=2 if impl.bf16_weights else FP32)
    )


def _assert_comm(model, tp, pp, dp, results):
    for per_rank in results:
        for result in per_rank:
            where = f"rank {result['coords']} ZeRO-{result['zero_stage']}"
            planned = _planned(model, tp, pp, dp, result)
            # tensor-parallel collectives of the layers, as parallel/comm.py records them
            recorded = _sums(((op, phase), n) for op, phase, n in result["tp_events"])
            layer_tp = [t for t in planned if t.group == "tp" and t.phase != "pipeline"]
            assert _sums(((t.op, t.phase), t.total) for t in layer_tp) == recorded, where
            # everything DeepSpeed sends: its logger records an all-gather by its input (1/g of the
            # gathered tensor), every other op by the tensor it sends or reduces
            logged = {}
            for op, sizes in result["deepspeed"].items():
                name = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}.get(op, op)
                if name == "recv":
                    continue  # the other side of a send
                for size, count in sizes.items():
                    if not bookkeeping(name, size):
                        logged[name] = logged.get(name, 0) + size * count
            deepspeed_side = [t for t in planned if t.group != "tp" or t.phase == "pipeline"]
            expected = _sums((t.op, t.total // t.group_size if t.op == "all_gather" else t.total) for t in deepspeed_side)
            assert logged == expected, f"{where}: DeepSpeed logged {logged}, planned {expected}"


def test_communication_per_step_equals_the_counters_at_tp2_pp2_dp2(run_3d):
    _assert_comm(MODEL_3D, 2, 2, 2, run_3d)


def test_communication_per_step_equals_the_counters_at_dp2_zero2_and_zero3(run_dp):
    _assert_comm(MODEL_DP, 1, 1, 2, run_dp)


def test_bf16_state_and_data_parallel_bytes_equal_deepspeeds_bf16_optimizer(run_dp_bf16):
    """Under bf16 at ZeRO 1 DeepSpeed's bf16 optimizer holds bf16 weights, its fp32 gradient buffer (the bf16
    gradients dropped as they are added: train/planner/estimate.py's bf16_gradient_bytes), fp32 masters and moments
    of its partition; it reduces the fp32 gradients cast to its communication dtype, bf16 (dp_grad_bytes), and
    all-gathers the updated bf16 weights."""
    _assert_state(MODEL_DP, 1, 1, 2, run_dp_bf16)
    _assert_comm(MODEL_DP, 1, 1, 2, run_dp_bf16)


def test_zero_partitions_shrink_the_optimizer_state_by_dp():
    """Independent of DeepSpeed's padding rules: ZeRO-1's master and moments on dp ranks add up to
    at least, and within the padding of, ZeRO-0's moments; weights stay whole."""
    params = rank_parameters(GPTConfig(**MODEL_3D), 2, 2, 0)
    n = sum(p.numel for p in params)
    zero0 = state_bytes(params, 0, 8)
    ranks = [state_bytes(params, 1, 8, r) for r in range(8)]
    assert zero0.moments == 2 * FP32 * n and zero0.master == 0
    total_moments = sum(r.moments for r in ranks)
    assert 2 * FP32 * n <= total_moments <= 2 * FP32 * (n + 2 * 8 * (len(params) * 4))
    assert all(r.weights >= FP32 * n for r in ranks)
