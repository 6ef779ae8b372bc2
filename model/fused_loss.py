"""The unembedding and the cross-entropy as one step, chunked over tokens: no (N, V) logits kept.

For final hidden states h (N, d) (after the last LayerNorm), the tied matrix W (Vp, d) whose first
V rows are the vocabulary (model/vocab.py), and targets y (N,), the loss is the mean over kept
tokens K = {n : y_n ≠ ignore_index} of

    ℓ_n = log Σ_{j<V} exp z_nj − z_{n,y_n},   z = h Wᵀ,

and its gradients, with g_nj = (softmax_j(z_n) − [j = y_n]) · [n ∈ K] / |K| (softmax over j < V;
padding columns j ≥ V get zero):

    ∂L/∂h = g W   (N, d),        ∂L/∂W = gᵀ h   (Vp, d).

Tokens are taken `chunk` at a time. A chunk's logits (C, Vp) are made by one product, read once for their
rows' softmax statistics and once more to be overwritten by g (model/loss_rows.py: one kernel each), and g
goes into both gradients' products: the gradients are made in the forward (when an input needs one) and
only scaled by ∂out/∂L in backward, with no recomputation and the plain path's three products. ∂L/∂h is
written by its product in the compute dtype, straight into its rows of one (N, d) tensor; ∂L/∂W is summed
over chunks in fp32 by the product itself (cuBLAS's fp32 output, on GPUs that have it), so no
weight-sized tensor is rounded, copied or added per chunk.

Chunks are sized from memory, not from a count (`token_chunk`): as many tokens as fit LOSS_CHUNK_BYTES of
logits in the compute dtype, the whole micro batch when that fits (one chunk: gpt3-125m's 16,384 tokens ×
50,304 rows are 1.6 GB in bf16). The planner counts the same chunk (train/planner/activations.py).

Memory, N tokens, vocabulary rows Vp (Vp/p per rank), a bytes an element in the compute dtype:
  plain path   logits (N, Vp) in the compute dtype, their fp32 copy and the saved softmax (N, V):
               about 10·N·V bytes at bf16 (3.3 GB each fp32 copy for N = 16384, V = 50257)
  this one     kept until backward: ∂L/∂h (a·N·d) and ∂L/∂W (4·Vp·d); during the loop, one chunk's
               logits (a·C·Vp, which become its g); under no_grad (evaluation) only the chunk.

Vocabulary parallelism (parallel/tensor.py) passes its shard of W, rows [start, start + Vp/p), and
two reductions over the tensor-parallel group; each chunk's statistics are then combined over the ranks:
M = max m, S = Σ s·exp(m − M), and the target logit summed (three all-reduces of C floats, as
_VocabParallelCrossEntropy makes). The h gradient is this rank's term of Σ_ranks; the caller's
copy_to_tp_region sums it.

Under autocast the products run in the autocast dtype (h and W cast once, as autocast would), the
statistics, losses and ∂L/∂W in fp32.
"""

from __future__ import annotations

from typing import Callable

import torch

from model.loss_rows import row_grad_, row_stats

LOSS_CHUNK_BYTES = 2 * 2**30  # a chunk's logits at most: under 3% of an 80 GB GPU, one chunk for gpt3-125m at 8 × 2048
MIN_CHUNK = 256  # tokens: a full matrix-product tile


def token_chunk(tokens: int, vocab_rows: int, element_bytes: int, budget: int = LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk: all of them when their logits (tokens, vocab_rows) of `element_bytes` each fit in
    `budget` bytes, else the most multiples of MIN_CHUNK that do (MIN_CHUNK at least)."""
    fit = budget // (vocab_rows * element_bytes)
    return tokens if fit >= tokens else max(MIN_CHUNK, fit // MIN_CHUNK * MIN_CHUNK)


def _add_product(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """total + a @ b in fp32 (total None: a @ b), a and b in the compute dtype. Half-precision operands go
    through the product's fp32 output where the backend has one (CUDA's cuBLAS: one kernel, the sum
    accumulated in place); elsewhere their product is rounded to the compute dtype, then added in fp32."""
    if a.dtype == torch.float32:
        return a @ b if total is None else total.addmm_(a, b)
    try:
        if total is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    except (NotImplementedError, TypeError):  # no fp32-output product on this backend (TypeError: no out_dtype)
        product = (a @ b).float()
        return product if total is None else total.add_(product)


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
            scale = keep / count  # (N,) fp32: 1/|K| for kept tokens, 0 for ignored ones
            if start == 0:  # this shard's columns begin at the vocabulary's first (the row ops mask by `owned`)
                local, owned = targets, keep & (targets < real)  # (N,) each
            else:
                local = targets - start
                owned = keep & (local >= 0) & (local < real)  # (N,): targets in this shard
                local = local.clamp(0, rows - 1)
            losses = []  # each chunk's (C,)
            grad_h = torch.empty(n, h.shape[1], dtype=dtype, device=h.device) if want_h else None
            grad_w = None
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = x[s:e] @ w.T  # (C, Vl) logits
                m, total, target = row_stats(z, local[s:e], owned[s:e], real)  # (C,) each
                if reduce_max is not None:  # combined over the vocabulary's shards (the reductions work in place)
                    shard_max, m = m, reduce_max(m.clone())
                    total = reduce_sum(total * torch.exp(shard_max - m))
                    target = reduce_sum(target)
                losses.append(m + total.log() - target)  # (C,)
                if want_h or want_w:
                    row_grad_(z, local[s:e], owned[s:e], m, total, scale[s:e], real)  # z is now g (C, Vl)
                    if want_h:
                        torch.mm(z, w, out=grad_h[s:e])  # (C, d)
                    if want_w:
                        grad_w = _add_product(grad_w, z.T, x[s:e])  # (Vl, d) fp32
            losses = losses[0] if len(losses) == 1 else torch.cat(losses)  # (N,)
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
    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the logits h Wᵀ over the first vocab_size columns, without making them
    all at once: h (…, d), targets (…), W (Vl, d) the vocabulary's rows [start, start + Vl) (all of
    them, padded, at one process; then no reductions). Equals F.cross_entropy(h Wᵀ[:, :V], targets,
    ignore_index); see the module docstring for the math, the memory and the reductions of a vocabulary
    shard. chunk: tokens per chunk (default: token_chunk's)."""
    flat = h.reshape(-1, h.shape[-1])  # (N, d)
    if chunk is None:
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        chunk = token_chunk(flat.shape[0], weight.shape[0], dtype.itemsize)
    return _FusedLinearCrossEntropy.apply(
        flat, weight, targets.reshape(-1), vocab_size, start, ignore_index, chunk, reduce_max, reduce_sum
    )
