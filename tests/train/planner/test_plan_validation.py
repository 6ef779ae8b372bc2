"""The step-time model against published large-scale training runs and against this project's own
measurements on an H100 (README, "How the predictions were validated").

Published runs report TFLOP/s per GPU counted with Megatron's formula, which includes activation
recomputation: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per step of B sequences. That and the
GPU count turn the reported figure into the measured step time; the planner predicts the step time
of the same model, layout, batch and hardware (A100 80GB, the a100-80g preset), with the published
system's precision (bf16 parameters: no per-micro-batch weight casts).
"""

from __future__ import annotations

import dataclasses

import pytest

from model import GPTConfig
from train.planner.activations import unembedding_rows
from train.planner.estimate import Implementation, Layout, _gemm_time, build_plan
from train.planner.hardware import preset

A100 = preset("a100-80g")
# Megatron-LM and Megatron-DeepSpeed as they ran in 2021–2022: bf16 (or fp16) parameters, fused kernels but the
# attention's scores written out (no fused attention kernel yet; Megatron's default attention dropout), fp32
# gradient reduction, the plain vocab-parallel loss (the logits kept), activations sequence first.
MEGATRON = Implementation(fp32_weights=False, materialized_attention=True, kernels_per_block=40, grad_reduce_bytes=4,
                          fused_loss=False, sequence_first=True)
# DeepSpeed ZeRO-3 as Narayanan et al. ran it: fp16 parameters gathered and gradients reduced in 2 bytes.
ZERO3 = dataclasses.replace(MEGATRON, grad_reduce_bytes=2)
# BLOOM's Jean Zay nodes: 4 × 100 Gb/s Omni-Path per node of 8 GPUs.
JEAN_ZAY = dataclasses.replace(A100, internode_gbps=4 * 100 / 8 / 8)

GPT3_175B = dict(n_layer=96, n_head=96, d_model=12288, vocab_size=51200)
MT_NLG_530B = dict(n_layer=105, n_head=128, d_model=20480, vocab_size=51200)
BLOOM_176B = dict(n_layer=70, n_head=112, d_model=14336, vocab_size=250880)

# (source, model, layout (tp, pp, dp, batch, micro batch, ZeRO, ckpt), implementation, hardware,
#  reported TFLOP/s per GPU, tolerance: 9% for the three PTD-P 175B runs and the 145.6B, 25% for the rest, 45% for
#  MT-NLG). Sources in docs/planner.md.
PUBLISHED = [
    ("Narayanan 2021 Table 2, PTD-P, 384 GPUs", GPT3_175B, (8, 12, 4, 1536, 1, 0, 1), MEGATRON, A100, 153, 0.09),
    ("Narayanan 2021 Table 2, PTD-P, 768 GPUs", GPT3_175B, (8, 12, 8, 1536, 1, 0, 1), MEGATRON, A100, 149, 0.09),
    ("Narayanan 2021 Table 2, PTD-P, 1536 GPUs", GPT3_175B, (8, 12, 16, 1536, 1, 0, 1), MEGATRON, A100, 141, 0.09),
    ("Narayanan 2021 Table 1, 145.6B", dict(n_layer=80, n_head=96, d_model=12288, vocab_size=51200),
     (8, 8, 24, 2304, 1, 0, 1), MEGATRON, A100, 148, 0.09),
    ("Narayanan 2021 Table 1, 310.1B", dict(n_layer=96, n_head=128, d_model=16384, vocab_size=51200),
     (8, 16, 15, 2160, 1, 0, 1), MEGATRON, A100, 155, 0.25),
    ("Narayanan 2021 Table 1, 529.6B", MT_NLG_530B, (8, 35, 9, 2520, 1, 0, 1), MEGATRON, A100, 163, 0.25),
    ("Narayanan 2021 Table 1, 1008B", dict(n_layer=128, n_head=160, d_model=25600, vocab_size=51200),
     (8, 64, 6, 3072, 1, 0, 1), MEGATRON, A100, 163, 0.25),
    ("BLOOM 176B, 384 GPUs", BLOOM_176B, (4, 12, 8, 2048, 2, 1, 1), MEGATRON, JEAN_ZAY, 150, 0.25),
    # not in the issue: the same paper's DeepSpeed ZeRO-3 runs (no model parallelism)
    ("Narayanan 2021 Table 2, ZeRO-3, 384 GPUs", GPT3_175B, (1, 1, 384, 1536, 4, 3, 1), ZERO3, A100, 144, 0.25),
    ("Narayanan 2021 Table 2, ZeRO-3, 768 GPUs", GPT3_175B, (1, 1, 768, 1536, 2, 3, 1), ZERO3, A100, 88, 0.25),
    ("Narayanan 2021 Table 2, ZeRO-3, 1536 GPUs", GPT3_175B, (1, 1, 1536, 1536, 1, 3, 1), ZERO3, A100, 44, 0.25),
    # MT-NLG is predicted 24–29% faster than it ran (docs/planner.md): checked against a looser bound
    ("MT-NLG 530B, 280 DGX nodes", MT_NLG_530B, (8, 35, 8, 1920, 1, 1, 1), MEGATRON, A100, 126, 0.45),
    ("MT-NLG 530B, 350 DGX nodes", MT_NLG_530B, (8, 35, 10, 1920, 1, 1, 1), MEGATRON, A100, 121, 0.45),
    ("MT-NLG 530B, 420 DGX nodes", MT_NLG_530B, (8, 35, 12, 1920, 1, 1, 1), MEGATRON, A100, 113, 0.45),
]


def test_a_materialized_attention_moves_what_megatrons_kernels_move():
    """The planner's materialized attention (Implementation.materialized_attention, for the published Megatron runs)
    against the op ledger's count of the same core as Megatron-LM ran it (2021): S = Q·Kᵀ as a batched product,
    softmax, attention dropout, O = P'·V, then the backward of each: six products of 2·T²·d_head FLOPs a head, each
    moving its 2-byte scores and two (T, d_head) operands, and the softmax's and dropout's kernels moving
    MATERIALIZED_SCORE_BYTES a score, forward and backward."""
    import torch

    from bench.op_ledger import OpLedger
    from train.planner.estimate import MATERIALIZED_SCORE_BYTES, _attention

    cfg = GPTConfig(name="tiny", n_layer=1, n_head=4, d_model=64, seq_len=32)
    layout = Layout(2, 1, 1, 2, 2)  # tp = 2, micro batches of 2 sequences
    heads, t, head_dim = layout.micro_batch * cfg.n_head // layout.tp, cfg.seq_len, cfg.d_model // cfg.n_head
    q, v = (torch.randn(heads, t, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    k_t = torch.randn(heads, head_dim, t, dtype=torch.bfloat16, requires_grad=True)  # Kᵀ, as the product takes it
    grad = torch.randn(heads, t, head_dim, dtype=torch.bfloat16)
    ledger = OpLedger()
    with ledger:
        ledger.recording = True
        probs = torch.softmax(torch.bmm(q, k_t), dim=-1)  # (heads, T, T)
        dropped = torch.native_dropout(probs, 0.1, True)[0]  # the one kernel CUDA's dropout runs, its mask kept
        torch.bmm(dropped, v).backward(grad)  # (heads, T, d_head)
    gemms = [op for op in ledger.ops if op.kind == "gemm"]
    others = [op for op in ledger.ops if op.kind == "memory"]
    scores, operand = heads * t * t, heads * t * head_dim
    assert len(gemms) == 6 and all(op.bytes == 2 * scores + 2 * 2 * operand for op in gemms)
    backward = [op.where.startswith("autograd") for op in others]  # the ops autograd ran for the backward
    assert sum(op.bytes for op, b in zip(others, backward) if not b) == MATERIALIZED_SCORE_BYTES[0] * scores
    assert sum(op.bytes for op, b in zip(others, backward) if b) == MATERIALIZED_SCORE_BYTES[1] * scores
    forward_s, backward_s, forward_flops, backward_flops = _attention(cfg, layout, MEGATRON, A100, 0)
    assert forward_flops + backward_flops == sum(op.flops for op in gemms)
    product = max(gemms[0].flops / A100.flops, gemms[0].bytes / A100.memory_bandwidth)
    assert forward_s == pytest.approx(2 * product + MATERIALIZED_SCORE_BYTES[0] * scores / A100.memory_bandwidth)
    assert backward_s == pytest.approx(4 * product + MATERIALIZED_SCORE_BYTES[1] * scores / A100.memory_bandwidth)


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. (2021), eq. 3: FLOPs of one step with full activation recomputation."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def predicted_tflops(model: dict, layout: tuple, implementation, hardware) -> float:
    tp, pp, dp, batch, micro, zero, ckpt = layout
    cfg = GPTConfig(name="published", seq_len=2048, **model)
    plan = build_plan(cfg, Layout(tp, pp, dp, batch, micro, zero, checkpoint_every=ckpt), hardware,
                      implementation=implementation)
    flops = megatron_flops(batch, 2048, model["n_layer"], model["d_model"], model["vocab_size"])
    return flops / plan.step_time_s / (tp * pp * dp) / 1e12


@pytest.mark.parametrize("source, model, layout, implementation, hardware, reported, tolerance", PUBLISHED,
                         ids=[row[0] for row in PUBLISHED])
def test_predicted_throughput_of_published_runs(source, model, layout, implementation, hardware, reported, tolerance):
    predicted = predicted_tflops(model, layout, implementation, hardware)
    assert predicted == pytest.approx(reported, rel=tolerance), f"{source}: predicted {predicted:.0f} TFLOP/s"


# This project's H100 80GB HBM3 (SXM), 2026-11-22: one-GPU gpt3d training steps (fp32 weights, bf16
# autocast, the Triton attention, AdamW, micro batches of T = 2048, the plain loss, the vocabulary
# 50257 not yet padded) measured with the procedure of bench/plan_check.py: (shape, micro batch,
# micro batches, checkpoint every, step s, peak GiB).
H100_MEASURED = [
    ((24, 16, 1024), 8, 2, 0, 0.333, 29.60),
    ((24, 16, 1024), 1, 4, 0, 0.368, 8.97),
    ((24, 16, 1536), 4, 2, 0, 0.310, 28.20),
    ((24, 16, 1536), 4, 2, 1, 0.388, 17.86),
    ((24, 16, 2048), 4, 2, 0, 0.438, 41.07),
    ((24, 16, 2048), 8, 2, 1, 0.936, 32.97),
    ((24, 16, 2048), 1, 8, 0, 0.814, 26.85),
    ((32, 32, 2560), 4, 2, 1, 0.946, 51.07),
    ((32, 32, 2560), 2, 2, 0, 0.481, 58.87),
]


@pytest.mark.parametrize("shape, micro, micro_batches, ckpt, seconds, peak_gib", H100_MEASURED)
def test_predictions_match_measured_steps_on_an_h100(shape, micro, micro_batches, ckpt, seconds, peak_gib):
    """Peak memory within 10% in every case; step time within 25%, except with one-sequence micro
    batches, where launching the kernels from Python costs more than running them (within 40%).
    Predicted for the code that was measured: the plain loss, and the unembedding's three GEMMs
    over the unpadded 50257 columns (cuBLAS's unaligned kernels) instead of the padded 50304."""
    n_layer, n_head, d_model = shape
    cfg = GPTConfig(name="h100", n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=2048)
    hw, measured_code = preset("h100-80g"), Implementation(fused_loss=False)
    layout = Layout(1, 1, 1, micro * micro_batches, micro, checkpoint_every=ckpt)
    plan = build_plan(cfg, layout, hw, implementation=measured_code)
    n, padded = micro * 2048, unembedding_rows(cfg, 1)
    unpadded = 3 * (_gemm_time(hw, measured_code, n, d_model, cfg.vocab_size, 2)
                    - _gemm_time(hw, measured_code, n, d_model, padded, 2))
    assert plan.peak_memory_gib == pytest.approx(peak_gib, rel=0.10)
    step_time = plan.step_time_s + micro_batches * unpadded
    assert step_time == pytest.approx(seconds, rel=0.25 if micro > 1 else 0.40)


# NeMo 24.07's published GPT-3 175B fp8 run (NeMo's performance summary): 512 H100 80GB, TP 4, PP 8, VP 6, global
# batch 2048, micro batch 2, sequence 2048, 842–895 model TFLOP/s per GPU. What the planner assumes of NeMo's
# kernels (Transformer Engine under Megatron-Core), none of it measured here: tensorwise float8 products at the
# float8 rate of the H100 preset with their casts fused (as gpt3d's compiled casts), the tensor-parallel collectives
# in ring steps behind the GEMMs in float8 too (TE's userbuffers, driven from C++: none of gpt3d's Python ring launches),
# the distributed optimizer's gradient reduction
# and weight gathering overlapped chunk by chunk, attention at half of peak, bf16 parameters, the plain loss.
NEMO_FP8 = dataclasses.replace(MEGATRON, fp8="tensorwise", compiled=True, ring_tp=True, ring_launches=False,
                               chunked_dp_overlap=True, materialized_attention=False, attention_efficiency=0.5)


def test_nemo_fp8_gpt3_175b_is_reproduced_within_15_percent():
    """Model TFLOP/s per GPU (model FLOPs: no recomputation counted, as NeMo counts them) within 15% of the
    published range's middle, 868."""
    cfg = GPTConfig(name="nemo-175b", seq_len=2048, **GPT3_175B)
    layout = Layout(4, 8, 16, 2048, 2, 1, sequence_parallel=True, schedule="interleaved", virtual_stages=6)
    plan = build_plan(cfg, layout, preset("h100-80g"), implementation=NEMO_FP8)
    predicted = plan.model_flops_per_step / plan.step_time_s / layout.gpus / 1e12
    assert predicted == pytest.approx((842 + 895) / 2, rel=0.15), predicted
    # the overlaps carry weight: without the chunked data-parallel overlap the prediction falls by more than 8%, and
    # without the ring overlap by more than 15%
    def without(**change) -> float:
        plan = build_plan(cfg, layout, preset("h100-80g"), implementation=dataclasses.replace(NEMO_FP8, **change))
        return plan.model_flops_per_step / plan.step_time_s / layout.gpus / 1e12

    assert without(chunked_dp_overlap=False) < 0.92 * predicted
    assert without(ring_tp=False) < 0.85 * predicted
