"""The step of a model trained on one GPU, launch by launch, as gpt3d's eager step issues it, priced by the
step bill's cost model (train/planner/kernel_costs.py).

Where a whole model trains on one GPU (tp = pp = dp = 1), a step is short enough that launches, the
memory-bound kernels and the shapes of small products decide its time, not the FLOPs alone. So the planner
lists the step's kernels here, with the shape of every product and the bytes of every other kernel, as the
step bill counts them on the real step (bench/step_bill.py), and prices the list with the same
`step_seconds`: the host issuing in order, the device running behind it. The list, per micro batch of
n = B·T tokens, c bytes an element in the compute dtype and r in the weights' and residual stream's:

  block forward (10)   LayerNorm, the qkv product, the attention kernel, the out product, the residual add;
                       LayerNorm, fc, GELU, proj, the residual add
  block backward (20)  each product's input and weight gradients and its bias sum (12), the attention's
                       3 launches, GELU's, both LayerNorms', both residual gradients' sums
  embedding            the two lookups and their sum; backward the two scatters and a sum
  head                 the final LayerNorm and its backward; the fused loss (model/fused_loss.py): per
                       chunk the logits' product, the rows' statistics and gradient kernels, the two gradient
                       products, a few per-token kernels; its backward's two scalings
                       (train.fused_loss=false: the logits, their fp32 copy, log-softmax, NLL and their
                       backward over n·V)
  under autocast       each linear's weight cast to bf16 every micro batch, and its input's
  the step             the loss's flag, the step's checks (train/guard/), then the optimizer: DeepSpeed's bf16
                       optimizer as gpt3d runs it (one add a parameter of its bf16 gradient to the fp32 one,
                       the norm over the flat buffer, the clip, fused AdamW, the bf16 copy, the zeroing:
                       train/run/bf16_optimizer.py), or, in fp32 and autocast, ClippingAdamW over the parameters
                       themselves (multi-tensor norm and clip, fused AdamW)

Multi-tensor kernels launch as bench/op_ledger.py counts them. Activation checkpointing and selective
recomputation add their forwards again in backward; fp8 is not listed: the planner keeps its FLOP-and-bytes
model for it (estimate.py).
"""

from __future__ import annotations

import math

from model import GPTConfig
from model.fused_loss import token_chunk
from model.vocab import padded_vocab_size
from train.planner.counts import rank_parameters
from train.planner.kernel_costs import Launch, StepTime, step_seconds
from train.planner.hardware import Hardware

FP32 = 4
CHUNK, CHUNKS_PER_LAUNCH = 65536, 320  # torch's multi_tensor_apply (bench/op_ledger.py)


def _gemm(m: int, n: int, k: int, c: int, out: int | None = None) -> Launch:
    """M×K by K×N in the compute dtype (out: the output's bytes an element, default c)."""
    return Launch("gemm", 1, float((m * k + k * n) * c + m * n * (out or c)), 2.0 * m * n * k, (m, n, k))


def _memory(moved: float, kernels: int = 1) -> Launch:
    return Launch("memory", kernels, float(moved), 0.0)


def _flat_launches(elements: int) -> int:
    """Launches of one multi-tensor kernel over flat buffers of `elements` elements."""
    return max(1, math.ceil(math.ceil(elements / CHUNK) / CHUNKS_PER_LAUNCH))


def _visible_pairs(t: int, window: int | None) -> float:
    """Query-key pairs of a causal sequence of t tokens (a band of `window` keys when banded)."""
    if window is None or window >= t:
        return t * (t + 1) / 2
    return window * (window + 1) / 2 + (t - window) * window


def block_launches(cfg: GPTConfig, layer: int, batch: int, c: int, r: int, autocast: bool) -> list[Launch]:
    """One block's forward then backward for `batch` sequences (module docstring)."""
    n, d, f, t = batch * cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.seq_len
    linears = [(3 * d, d), (d, d), (f, d), (d, f)]  # (out, in): qkv, attention's out, fc, proj
    attention = 4.0 * batch * d * _visible_pairs(t, cfg.window_of(layer))  # QKᵀ and PV over the band
    casts = [_memory((o * i + o) * (r + c)) for o, i in linears] if autocast else []
    norm, residual = _memory(n * d * (r + r)), _memory(n * d * (r + c + r))
    forward = [
        *casts, norm, _gemm(n, 3 * d, d, c),
        Launch("attention", 1, float(n * 4 * d * c), attention, head_dim=cfg.d_head),
        _gemm(n, d, d, c), residual, norm, _gemm(n, f, d, c), _memory(2 * n * f * c), _gemm(n, d, f, c), residual,
    ]
    qkv, out, fc, proj = ([_gemm(n, i, o, c), _gemm(o, i, n, c), _memory((n * o + o) * c)] for o, i in linears)
    norm_grad, residual_grad = _memory(3 * n * d * r), _memory(3 * n * d * r)  # a LayerNorm's; two gradients summed
    backward = [
        *proj, _memory(3 * n * f * c), *fc, norm_grad, residual_grad, *out,
        Launch("attention", 3, float(n * (8 * d * c + 8 * d)), 2.5 * attention, head_dim=cfg.d_head, backward=True),
        *qkv, norm_grad, residual_grad,
    ]
    return forward + backward


def loss_launches(cfg: GPTConfig, batch: int, c: int, r: int, fused: bool) -> list[Launch]:
    """The head's final LayerNorm and the loss, forward and backward."""
    n, d, rows, vocab = batch * cfg.seq_len, cfg.d_model, padded_vocab_size(cfg.vocab_size), cfg.vocab_size
    norm = [_memory(n * d * 2 * r)]
    if fused:
        chunk = token_chunk(n, rows, c)
        launches = [_memory(n * 8, 4)]  # the kept tokens, their count and scale, the owned targets
        for start in range(0, n, chunk):
            rows_n = min(chunk, n - start)
            logits = rows_n * rows * c
            launches += [_gemm(rows_n, rows, d, c), Launch("loss", 1, float(logits), 0.0),
                         _memory(rows_n * 4 * 4, 3), Launch("loss", 1, float(2 * logits), 0.0),
                         _gemm(rows_n, d, rows, c), _gemm(rows, d, rows_n, c, out=FP32)]
        launches += [_memory(n * 8, 3), _memory(n * d * c * 2), _memory(rows * d * (FP32 * 2 + r), 2)]
        return norm + launches + norm
    logits = n * vocab
    return norm + [_gemm(n, rows, d, c), _memory(logits * (c + FP32)), _memory(logits * 2 * FP32),
                   _memory(logits * FP32), _memory(logits * 2 * FP32, 2), _memory(logits * 3 * FP32),
                   _memory(logits * (FP32 + c)), _gemm(n, d, rows, c), _gemm(rows, d, n, c)] + norm


def embedding_launches(cfg: GPTConfig, batch: int, r: int) -> list[Launch]:
    n, d, rows = batch * cfg.seq_len, cfg.d_model, padded_vocab_size(cfg.vocab_size)
    forward = [_memory(cfg.seq_len * 8), _memory(n * (d * r + 8)), _memory(n * d * r), _memory(3 * n * d * r)]
    backward = [_memory(n * d * r), _memory((n * d + rows * d) * r), _memory((n * d + cfg.seq_len * d) * r),
                _memory(3 * cfg.seq_len * d * r)]
    return forward + backward


def optimizer_launches(cfg: GPTConfig, bf16_weights: bool) -> list[Launch]:
    """The update after the last micro batch (module docstring)."""
    params = rank_parameters(cfg, 1, 1, 0)
    elements = sum(p.numel for p in params)
    if bf16_weights:
        adds = [_memory(p.numel * (2 + FP32 + FP32)) for p in params]  # each bf16 gradient into its fp32 one
        flat = _flat_launches(elements)
        return adds + [Launch("multi_tensor", flat + 1, float(elements * FP32), 0.0), _memory(64, 6),
                       Launch("multi_tensor", flat, float(elements * 2 * FP32), 0.0),
                       Launch("multi_tensor", flat, float(elements * 7 * FP32), 0.0), _memory(8, 2),
                       _memory(elements * (FP32 + 2)), _memory(elements * FP32, 2)]
    tensors = math.ceil(len(params) / 110)
    return [Launch("multi_tensor", tensors + 1, float(elements * FP32), 0.0), _memory(64, 6),
            Launch("multi_tensor", tensors, float(elements * 2 * FP32), 0.0),
            Launch("multi_tensor", math.ceil(len(params) / 36), float(elements * 7 * FP32), 0.0), _memory(8, 2)]


def step_launches(cfg: GPTConfig, micro_batch: int, micro_batches: int, precision: str, fused_loss: bool = True,
                  checkpoint_every: int = 0, selective: bool = False) -> list[Launch]:
    """A step's launches in order (module docstring); precision: fp32, autocast or bf16. Activation checkpointing
    (checkpoint_every > 0: every block sits in a recomputed segment) runs each block's forward again before its
    backward; selective recomputation its two LayerNorms and GELU."""
    c = FP32 if precision == "fp32" else 2
    r = 2 if precision == "bf16" else FP32
    n, d, f = micro_batch * cfg.seq_len, cfg.d_model, cfg.d_ff
    one = embedding_launches(cfg, micro_batch, r)[:4]
    for layer in range(cfg.n_layer):
        one += block_launches(cfg, layer, micro_batch, c, r, precision == "autocast")[:10]
    one += loss_launches(cfg, micro_batch, c, r, fused_loss) + [_memory(16, 4)]  # with the loss's flag
    for layer in reversed(range(cfg.n_layer)):
        block = block_launches(cfg, layer, micro_batch, c, r, precision == "autocast")
        if checkpoint_every > 0:
            one += block[:10]
        elif selective:
            one += [_memory(2 * n * d * r), _memory(2 * n * d * r), _memory(2 * n * f * c)]
        one += block[10:]
    one += embedding_launches(cfg, micro_batch, r)[4:]
    return one * micro_batches + [_memory(8, 1), *optimizer_launches(cfg, precision == "bf16")]


def one_gpu_step(cfg: GPTConfig, micro_batch: int, micro_batches: int, precision: str, hw: Hardware,
                 fused_loss: bool = True, checkpoint_every: int = 0,
                 selective: bool = False) -> tuple[StepTime, StepTime]:
    """(the whole step, its optimizer's launches alone) priced on `hw`."""
    launches = step_launches(cfg, micro_batch, micro_batches, precision, fused_loss, checkpoint_every, selective)
    update = optimizer_launches(cfg, precision == "bf16")
    return step_seconds(hw, launches), step_seconds(hw, update)
