"""The unembedding and the cross-entropy as one step, chunked over tokens: no (N, V) logits kept.

For final hidden states h (N, d) (after the last LayerNorm), the tied matrix W (Vp, d) whose first
V rows are the vocabulary (model/vocab.py), and targets y (N,), the loss is the mean over kept
tokens K = {n : y_n ≠ ignore_index} of

    ℓ_n = log Σ_{j<V} exp z_nj − z_{n,y_n},   z = h Wᵀ,

and its gradients, with g_nj = (softmax_j(z_n) − [j = y_n]) · [n ∈ K] / |K| (softmax over j < V;
padding columns j ≥ V get zero):

    ∂L/∂h = g W   (N, d),        ∂L/∂W = gᵀ h   (Vp, d).

Tokens are taken `chunk` at a time: a chunk's logits (C, Vp) are made, turned into its losses and
its part of both gradients, and dropped. The gradients are therefore computed in the forward pass
(when an input needs one) and only scaled by ∂out/∂L in backward: no recomputation, the same three
matrix multiplies as the plain path.

Memory, N tokens, vocabulary rows Vp (Vp/p per rank), fp32 (4 bytes) unless said:
  plain path   logits (N, Vp) in the compute dtype, their fp32 copy and the saved softmax (N, V):
               about 10·N·V bytes at bf16 (3.3 GB each fp32 copy for N = 16384, V = 50257)
  this one     kept until backward: ∂L/∂h (N, d) and ∂L/∂W (Vp, d), 4·(N + Vp)·d bytes (0.2 GB for
               gpt3-125m at N = 16384); during the loop, one chunk's logits and gradient, about
               10·C·Vp bytes; under no_grad (evaluation) only the chunk.
The default chunk (token_chunk) makes one chunk's logits about as large as h itself: C ≈ N·d / Vp,
at least 256 tokens (a full GEMM tile on the GPU).

Vocabulary parallelism (parallel/tensor.py) passes its shard of W, rows [start, start + Vp/p), and
two reductions over the tensor-parallel group; each chunk then takes the three all-reduces of
_VocabParallelCrossEntropy (max, target logit, sum of exponentials, each of C floats). The h
gradient is this rank's term of Σ_ranks; the caller's copy_to_tp_region sums it.

Under autocast the multiplies run in the autocast dtype (h and W cast once, as autocast would),
softmax and losses in fp32, ∂L/∂W accumulated over chunks in fp32.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def token_chunk(tokens: int, d_model: int, vocab_rows: int) -> int:
    """Tokens per chunk: a chunk's logits (C, Vp) about the size of h (N, d), a power of two ≥ 256."""
    wanted = max(1, tokens * d_model // vocab_rows)
    return min(tokens, max(256, 2 ** math.ceil(math.log2(wanted))))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """loss = mean_{n∈K} ℓ_n from h (N, d) and W (Vl, d) (see the module docstring)."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size, start, ignore_index, chunk, reduce_max, reduce_sum):
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        want_h, want_w = ctx.needs_input_grad[:2]
        n, rows = h.shape[0], weight.shape[0]
        real = min(max(vocab_size - start, 0), rows)  # this shard's columns that are vocabulary
        with torch.autocast(device, enabled=False):
            x, w = h.to(dtype), weight.to(dtype)  # (N, d), (Vl, d)
            keep = targets != ignore_index  # (N,)
            count = keep.sum()
            local = targets - start
            owned = keep & (local >= 0) & (local < real)  # (N,): targets in this shard
            local = local.clamp(0, rows - 1)
            losses = torch.empty(n, dtype=torch.float32, device=h.device)
            grad_h = torch.empty(n, h.shape[1], dtype=torch.float32, device=h.device) if want_h else None
            grad_w = torch.zeros(rows, h.shape[1], dtype=torch.float32, device=h.device) if want_w else None
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = (x[s:e] @ w.T).float()  # (C, Vl)
                z[:, real:] = float("-inf")  # padding never enters the softmax
                m = reduce_max(z.max(dim=-1).values)  # (C,)
                z -= m.unsqueeze(-1)
                z_target = torch.where(owned[s:e], z.gather(-1, local[s:e].unsqueeze(-1)).squeeze(-1), 0.0)
                z_target = reduce_sum(z_target)  # (C,)
                z = z.exp_()
                total = reduce_sum(z.sum(dim=-1))  # (C,)
                losses[s:e] = total.log() - z_target
                if want_h or want_w:
                    g = z.div_(total.unsqueeze(-1))  # (C, Vl) softmax
                    # − 1 at each owned target's column (− 0 elsewhere): no host sync to find the rows
                    g.scatter_add_(1, local[s:e].unsqueeze(-1), -owned[s:e].to(g.dtype).unsqueeze(-1))
                    g *= (keep[s:e] / count).unsqueeze(-1)
                    g = g.to(dtype)
                    if want_h:
                        grad_h[s:e] = g @ w  # (C, d)
                    if want_w:
                        grad_w += (g.T @ x[s:e]).float()  # (Vl, d)
            loss = torch.where(keep, losses, 0.0).sum() / count
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        grad_h = None if grad_h is None else (grad_h * grad_loss).to(h_dtype)
        grad_w = None if grad_w is None else (grad_w * grad_loss).to(w_dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    ignore_index: int = -100,
    chunk: int | None = None,
    start: int = 0,
    reduce_max: Callable[[torch.Tensor], torch.Tensor] = _identity,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = _identity,
) -> torch.Tensor:
    """Mean cross-entropy of the logits h Wᵀ over the first vocab_size columns, without making them
    all at once: h (…, d), targets (…), W (Vl, d) the vocabulary's rows [start, start + Vl) (all of
    them, padded, at one process). Equals F.cross_entropy(h Wᵀ[:, :V], targets, ignore_index); see
    the module docstring for the math, the memory and the reductions of a vocabulary shard."""
    flat = h.reshape(-1, h.shape[-1])  # (N, d)
    chunk = chunk or token_chunk(flat.shape[0], flat.shape[1], weight.shape[0])
    return _FusedLinearCrossEntropy.apply(
        flat, weight, targets.reshape(-1), vocab_size, start, ignore_index, chunk, reduce_max, reduce_sum
    )
