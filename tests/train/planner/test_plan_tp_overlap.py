"""The planner's model of parallel.tp_comm_overlap (parallel/overlap.py), against a count by hand.

Under sequence parallelism each block runs four collectives per linear pair: the all-gather of the
LayerNorm output into attn.qkv and mlp.fc, their input gradients' reduce-scatter, the reduce-scatter of
attn.proj's and mlp.proj's outputs and the all-gather of their output gradients. With the ring overlap each
runs as p − 1 exchanges of 1/p of the tensor, each behind a GEMM chunk of 1/p of its layer's GEMM, which
runs `ring_gemm_slowdown` slower beside it: exposed (p − 1)·(max(exchange, (1 + s)·G/p) − G/p). Without it
each collective is exposed whole ((p − 1)/p of the tensor on the wire, plus the latency). Nothing else
changes: the same layout's other collectives, its compute and its memory are the plan without the ring (the ring
layers' extra launches, RING_LAUNCHES, stay under the GPU's time at micro batches of 8 sequences).
"""

from __future__ import annotations

import dataclasses

import pytest

from model import GPTConfig
from train.planner.estimate import (
    COLLECTIVE_LATENCY_S,
    RING_COPY_LAUNCHES,
    RING_LAUNCHES,
    RING_WEIGHT_CAST_LAUNCHES,
    build_plan,
)
from train.planner.hardware import preset
from train.planner.layout import Layout, for_precision

H100 = preset("h100-80g")
CFG = GPTConfig(name="6.7b-8", n_layer=8, n_head=32, d_model=4096, seq_len=2048)
TP, MICRO = 4, 8
LAYOUT = Layout(TP, 1, 1, 2 * MICRO, MICRO, sequence_parallel=True)  # 2 micro batches of 8 sequences


def _hand_tp_seconds_saved(slowdown: float) -> float:
    """Per micro batch: the four collectives of both linears of every block, whole minus ring-exposed."""
    n, d, f, p = MICRO * CFG.seq_len, CFG.d_model, 4 * CFG.d_model, TP
    nbytes = n * d * 2  # bf16 weights: the residual stream and the matmuls in bf16
    bandwidth = H100.nvlink_gbps * 1e9 * H100.link_efficiency
    flops = H100.peak_tflops * 1e12 * H100.gemm_efficiency

    def gemm(k, m):  # GEMM-bound at these shapes
        return 2 * n * k * m / flops

    pairs = {  # the GEMMs each collective hides behind: (attention's linear, MLP's)
        "all-gather forward (qkv, fc)": (gemm(d, 3 * d / p), gemm(d, f / p)),
        "reduce-scatter backward (their input gradients)": (gemm(3 * d / p, d), gemm(f / p, d)),
        "reduce-scatter forward (proj, mlp.proj)": (gemm(d / p, d), gemm(f / p, d)),
        "all-gather backward (their input gradients)": (gemm(d, d / p), gemm(d, f / p)),
    }
    whole = (p - 1) / p * nbytes / bandwidth + COLLECTIVE_LATENCY_S
    exchange = nbytes / p / bandwidth + COLLECTIVE_LATENCY_S
    saved = 0.0
    for gemms in pairs.values():
        for g in gemms:
            ring = (p - 1) * (max(exchange, (1 + slowdown) * g / p) - g / p)
            saved += whole - ring
    return CFG.n_layer * saved


@pytest.mark.parametrize("slowdown", [0.0, 0.1, 1.0])
def test_ring_overlap_hides_what_the_hand_count_says_and_changes_nothing_else(slowdown):
    plain = for_precision("bf16")
    ring = dataclasses.replace(for_precision("bf16", tp_comm_overlap=True), ring_gemm_slowdown=slowdown)
    without, with_ring = build_plan(CFG, LAYOUT, H100, implementation=plain), build_plan(CFG, LAYOUT, H100, implementation=ring)
    (a,), (b,) = without.ranks, with_ring.ranks
    assert a.time["tp_comm_s"] - b.time["tp_comm_s"] == pytest.approx(_hand_tp_seconds_saved(slowdown), rel=1e-9)
    n, d, f, p = MICRO * CFG.seq_len, CFG.d_model, 4 * CFG.d_model, TP
    # the operand each ring scatters (qkv's and fc's g, proj's and mlp.proj's x) copied into sequence-major pieces
    # once (micro batches of 8 sequences): a bf16 read and write of each element
    copies = CFG.n_layer * 2 * 2 * n * (3 * d / p + f / p + d / p + f / p) / H100.memory_bandwidth
    assert b.time["compute_s"] - a.time["compute_s"] == pytest.approx(copies, rel=1e-9)
    sequence_first = dataclasses.replace(ring, sequence_first=True)  # (T, B, d) activations: the pieces contiguous
    (first,) = build_plan(CFG, LAYOUT, H100, implementation=sequence_first).ranks
    assert first.time["compute_s"] == a.time["compute_s"]
    assert b.peak_bytes == a.peak_bytes
    assert b.time["tp_comm_s"] > 0  # the embedding's, the head's and the LayerNorm gradients' stay exposed
    # a GEMM twice as slow beside an exchange loses more than the ring hides: the plan then says so
    assert (with_ring.step_time_s < without.step_time_s) == (_hand_tp_seconds_saved(slowdown) > 0)


def test_ring_overlap_needs_sequence_parallelism_and_float8_tensorwise():
    no_sp = dataclasses.replace(LAYOUT, sequence_parallel=False)
    plain, ring = for_precision("bf16"), for_precision("bf16", tp_comm_overlap=True)
    assert build_plan(CFG, no_sp, H100, implementation=ring).step_time_s == build_plan(
        CFG, no_sp, H100, implementation=plain).step_time_s
    with pytest.raises(ValueError, match="tp_comm_overlap=true with train.fp8_recipe=rowwise"):
        for_precision("fp8", fp8_recipe="rowwise", tp_comm_overlap=True)


def test_float8_under_the_ring_gathers_a_byte_an_element_casts_once_and_keeps_float8_inputs():
    """fp8 (tensorwise, compiled) with the ring against the same without it, by hand (parallel/ring_operands.py):
    - the gathers of the block linears move n·d bytes (a byte an element) where the plain path's LayerNorms
      gather bf16 (2·n·d); the reduce-scatters stay bf16;
    - the casts: per element of x, W and g, 8 bytes each without the ring; with it a column layer's x
      5/p + 2 (its piece cast, its gathered float8 copied into the weight gradient's layout) and g 7 + 2 (copied
      into sequence-major pieces too: micro batches of 8 sequences), a row layer's x 7 + 2 and g 5/p + 2, W 8
      once a step (model/float8_weights.py: 4 a micro batch here); and a row layer reduces one more amax (its
      g's) in the backward;
    - memory: each block keeps its two column inputs in float8 (d a token instead of 2d each, gathered),
      attn.proj its input in float8 beside the attention's bf16 output (d/p more a token), and mlp.proj its input
      in float8 instead of GELU's bf16 output (f/p less a token).
    The GPU's time compared with no time for the host's launches; with 30 µs a launch, the eager ring layers'
    launches (100 a block and RING_LAUNCHES) bound the fp8 micro batch of one sequence."""
    n, d, f, p = MICRO * CFG.seq_len, CFG.d_model, 4 * CFG.d_model, TP
    x_w_g = {"attn.qkv": (d, 3 * d // p, True), "attn.proj": (d // p, d, False),
             "mlp.fc": (d, f // p, True), "mlp.proj": (f // p, d, False)}
    def plan(**settings):
        implementation = dataclasses.replace(for_precision("fp8", compiled=True, **settings), host_seconds_per_kernel=0)
        return build_plan(CFG, LAYOUT, H100, implementation=implementation)

    plain, ring = plan(), plan(tp_comm_overlap=True)
    (a,), (b,) = plain.ranks, ring.ranks

    def gathered(rank):  # bytes per step
        return sum(t.total for t in rank.transfers if t.group == "tp" and t.op == "all_gather")

    ringed = {(t.linear, t.op): t.nbytes for t in b.transfers if t.linear}
    assert ringed == {(name, op): n * d * (1 if op == "all_gather" else 2) for name in x_w_g
                      for op in ("all_gather", "reduce_scatter")}
    micro_batches = 2  # a block's four gathers a micro batch (two forward, two backward): 2·n·d bytes, or n·d
    assert gathered(a) - gathered(b) == CFG.n_layer * micro_batches * 4 * (2 * n * d - n * d)
    saved = 0.0
    for k, m, column in x_w_g.values():
        cx, cg = (5 / p + 2, 7 + 2) if column else (7 + 2, 5 / p + 2)  # the scattered operand copied in pieces
        cw = 8 / 2  # W's amax and casts kept through the step: once in its 2 micro batches
        saved += ((8 - cx) * n * k + (8 - cw) * k * m + (8 - cg) * n * m) / H100.memory_bandwidth
    extra_reductions = 2 * COLLECTIVE_LATENCY_S  # one per row layer
    per_micro_batch = CFG.n_layer * (saved - extra_reductions)
    assert a.time["compute_s"] - b.time["compute_s"] == pytest.approx(per_micro_batch, rel=1e-9)
    kept = CFG.n_layer * n * (2 * d - d / p + f / p)  # bytes a micro batch saves less
    assert a.activations.saved - b.activations.saved == pytest.approx(kept, abs=CFG.n_layer)
    launches = 100 + sum(a + b * p for a, b in (RING_LAUNCHES[True, column] for column in (True, False, True, False)))
    launches += 4 * RING_WEIGHT_CAST_LAUNCHES / micro_batches  # the weights' casts, in a step's first micro batch
    launches -= 4 * RING_COPY_LAUNCHES  # one sequence a micro batch (below): no scattered operand is copied
    one_sequence = dataclasses.replace(LAYOUT, global_batch=2, micro_batch=1)  # a GPU's work an eighth of the above
    eager_ring = for_precision("fp8", compiled=True, tp_comm_overlap=True)
    small = build_plan(CFG, one_sequence, H100,
                       implementation=dataclasses.replace(eager_ring, host_seconds_per_kernel=0)).ranks[0]
    launched = build_plan(CFG, one_sequence, H100, implementation=eager_ring)
    assert launched.ranks[0].time["compute_s"] >= CFG.n_layer * launches * 30e-6 > small.time["compute_s"]
