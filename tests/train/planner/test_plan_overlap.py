"""Overlapped communication, sequence parallelism at pp > 1, and the ZeRO bucket settings, in the
planner: each against hand-computed times and sizes.

Overlap has two regimes that need no knowledge of the code: when a collective is much slower than
the GEMM it runs beside, overlapping saves exactly the GEMM's time; when it is much faster, it
saves the whole collective.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import GPTConfig
from model.gpt import make_layer
from train.planner.counts import block_elements
from train.planner.estimate import COLLECTIVE_LATENCY_S, Layout, build_plan, for_precision
from train.planner.hardware import preset
from train.planner.search import candidate_layouts, layout_problem
from train.planner.zero_buckets import zero_optimization

H100 = preset("h100-80g")
CFG = GPTConfig(name="1.3b", n_layer=4, n_head=16, d_model=2048, seq_len=2048)
BF16, BF16_SERIAL = for_precision("bf16"), for_precision("bf16", overlap_communication=False)


def _tp_seconds(hw, overlap: bool, sequence_parallel: bool = False) -> float:
    layout = Layout(2, 1, 1, 1, 1, sequence_parallel=sequence_parallel)
    return build_plan(CFG, layout, hw, implementation=BF16 if overlap else BF16_SERIAL).ranks[0].time["tp_comm_s"]


def test_slow_input_gradient_collectives_hide_exactly_their_weight_gradient_gemms():
    slow = dataclasses.replace(H100, nvlink_gbps=1.0)
    n, d, f = 2048, 2048, 8192
    gemms = 2 * n * d * (3 * d // 2) / H100.flops + 2 * n * d * (f // 2) / H100.flops  # attn.qkv, mlp.fc (FLOP-bound)
    saved = _tp_seconds(slow, False) - _tp_seconds(slow, True)
    assert saved == pytest.approx(CFG.n_layer * gemms, rel=1e-9)
    # under sequence parallelism parallel/tensor.py overlaps nothing, and the plan hides nothing
    assert _tp_seconds(slow, False, True) == _tp_seconds(slow, True, True)


def test_fast_input_gradient_collectives_are_hidden_whole():
    fast = dataclasses.replace(H100, nvlink_gbps=1e9)
    saved = _tp_seconds(fast, False) - _tp_seconds(fast, True)
    assert saved == pytest.approx(2 * CFG.n_layer * COLLECTIVE_LATENCY_S, rel=1e-3)  # two per block, latency only


def test_zero_gradient_reduction_hides_behind_the_backward_and_the_gather_stays():
    fast = dataclasses.replace(H100, internode_gbps=1e9, nvlink_gbps=1e9)
    zero2 = Layout(1, 1, 16, 64, 1, zero_stage=2)  # 4 micro batches, each reduced during its backward
    serial = build_plan(CFG, zero2, fast, implementation=BF16_SERIAL).ranks[0]
    overlapped = build_plan(CFG, zero2, fast, implementation=BF16).ranks[0]
    assert serial.time["dp_comm_s"] == pytest.approx(5 * COLLECTIVE_LATENCY_S, rel=1e-3)  # 4 all-reduces, 1 gather
    assert overlapped.time["dp_comm_s"] == pytest.approx(COLLECTIVE_LATENCY_S, rel=1e-3)  # the gather after the step
    # nothing hides where DeepSpeed reduces after the backward: bf16's BF16_Optimizer (ZeRO 1), and
    # its pipeline engine (ZeRO 1 under autocast at pp = 2); autocast's ZeRO 1 at pp = 1 does hide
    autocast = for_precision("autocast"), for_precision("autocast", overlap_communication=False)
    for layout, implementations, hides in ((dataclasses.replace(zero2, zero_stage=1), (BF16, BF16_SERIAL), False),
                                           (Layout(1, 2, 8, 64, 1, zero_stage=1), autocast, False),
                                           (dataclasses.replace(zero2, zero_stage=1), autocast, True)):
        on, off = (build_plan(CFG, layout, fast, implementation=i).ranks[0].time["dp_comm_s"] for i in implementations)
        assert (on < off) == hides, layout


def test_sequence_parallelism_runs_at_pp_above_1():
    layout = Layout(2, 2, 1, 32, 16, sequence_parallel=True)  # micro batches long enough not to be host-bound
    assert layout_problem(CFG, layout) is None
    assert any(c.sequence_parallel and c.pp > 1 for c in candidate_layouts(CFG, 8, 8, 8))
    plan = build_plan(CFG, layout, H100, implementation=BF16)
    pipeline = [t for t in plan.ranks[0].transfers if t.group == "pp" or t.what == "partitioned pipeline tensors"]
    sends = [t for t in pipeline if t.op == "send"]
    assert [t.op for t in pipeline] == ["send", "send", "all_reduce"]  # each rank's own part: nothing gathered
    assert sends[0].nbytes == 16 * 2048 * 2048 * 2 // 2  # its half of the sequence, bf16
    assert sends[1].nbytes == 16 * 2048 * 8  # the targets, whole, with it
    no_sp = build_plan(CFG, dataclasses.replace(layout, sequence_parallel=False), H100, implementation=BF16)
    n, d = 16 * 2048, 2048  # LayerNorms and residual adds: 2·2·r·d + 2·(2r + a)·d bytes a token, halved by σ = 2
    halved = 3 * 2 * n * (2 * 2 * 2 * d + 2 * (2 * 2 + 2) * d) / 2 / H100.memory_bandwidth  # 2 blocks, ×3 for backward
    assert no_sp.ranks[0].time["compute_s"] - plan.ranks[0].time["compute_s"] == pytest.approx(halved, rel=1e-9)


def test_a_block_has_the_parameters_the_bucket_is_sized_by():
    with torch.device("meta"):
        block = make_layer(CFG, 1)
    assert block_elements(CFG, 1) == sum(p.numel() for p in block.parameters())
    d = 12288  # GPT-3 175B at tp = 8: matrices 12d²/8; biases 3d/8 + d + 4d/8 + d; LayerNorms 4d
    gpt3 = GPTConfig(name="175b", n_layer=96, n_head=96, d_model=d)
    assert block_elements(gpt3, 8) == 12 * d * d // 8 + d * 3 // 8 + d + d * 4 // 8 + d + 4 * d == 226_576_896


@pytest.mark.parametrize("zero, pp, keys", [
    (0, 2, {"stage"}),
    (1, 2, {"stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size"}),
    (2, 1, {"stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size"}),
    (3, 1, {"stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold"}),
])
def test_zero_settings_are_deepspeeds_and_sized_by_one_block(zero, pp, keys):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    plan = build_plan(CFG, Layout(2, pp, 4 // pp, 8, 1, zero_stage=zero), H100, implementation=BF16)
    settings = zero_optimization(plan)
    assert set(settings) == keys and settings["stage"] == zero
    parsed = DeepSpeedZeroConfig(**settings)  # DeepSpeed accepts every key and value
    if zero:
        assert parsed.overlap_comm and parsed.reduce_bucket_size == block_elements(CFG, 2) == 12 * 2048**2 // 2 + 2048 * 19 // 2  # biases 3d/2 + d + 4d/2 + d, LayerNorms 4d
    if zero == 3:
        assert parsed.prefetch_bucket_size == block_elements(CFG, 2) and parsed.param_persistence_threshold == 100_000
