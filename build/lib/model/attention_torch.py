"""Memory-lean attention in torch ops: the CPU path of model.attention, same math as the kernel.

Key j is visible to query i iff lo ≤ j − i ≤ hi (model.attention.band_limits). Per (batch, head),
with S = Q Kᵀ/√D (invisible entries −∞):
  forward   LSE_i = log Σ_j exp(S_ij),  P = exp(S − LSE),  O = P V        → saves only O and LSE
  backward  Δ_i = Σ_d dO_id O_id  (= rowsum(dP ⊙ P), so P is never stored)
            P recomputed from S and LSE,  dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ⊙ (dP − Δ),
            dQ = dS K/√D,  dK = dSᵀ Q/√D
Queries are processed `block` rows at a time, each against only the key range its band can
reach, so memory is O(T·D + block·T) and keys outside the band cost nothing. bf16/fp16 inputs
are computed in float32; float32 and float64 in their own precision.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable


def banded_attention(q, k, v, lo: int, hi: int, block: int = 128):
    """softmax(QKᵀ/√D + band mask) V for q, k, v of shape (B, H, T, D); differentiable once."""
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape (B, H, T, D); got {q.shape}, {k.shape}, {v.shape}")
    return _BandedAttention.apply(q, k, v, lo, hi, block)


class _BandedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lo, hi, block):
        o, lse = _forward(q, k, v, lo, hi, block)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.band = (lo, hi, block)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, o, lse, do, *ctx.band)
        return dq, dk, dv, None, None, None


def _forward(q, k, v, lo, hi, block):
    """O (B, H, T, D) in q's dtype and LSE (B, H, T) in the compute dtype."""
    b, h, t, d = q.shape
    ct = _compute_dtype(q)
    qs = q.to(ct) * (1.0 / math.sqrt(d))  # (B, H, T, D), Q/√D once for all blocks
    o = torch.empty(b, h, t, d, dtype=q.dtype, device=q.device)  # (B, H, T, D)
    lse = torch.empty(b, h, t, dtype=ct, device=q.device)  # (B, H, T)
    for q0, q1, k0, k1 in _blocks(t, lo, hi, block):
        s = _scores(qs, k, q0, q1, k0, k1, lo, hi, ct)  # (B, H, q1−q0, k1−k0)
        m = s.amax(dim=-1, keepdim=True)  # (B, H, q1−q0, 1)
        p = s.sub_(m).exp_()  # (B, H, q1−q0, k1−k0), unnormalised
        row_sum = p.sum(dim=-1, keepdim=True)  # (B, H, q1−q0, 1)
        o[:, :, q0:q1] = (p @ v[:, :, k0:k1].to(ct)).div_(row_sum)  # (B, H, q1−q0, D)
        lse[:, :, q0:q1] = (m + row_sum.log()).squeeze(-1)
    return o, lse


def _backward(q, k, v, o, lse, do, lo, hi, block):
    """dQ, dK, dV (each (B, H, T, D), q's dtype), recomputing P block by block from LSE."""
    t, d = q.shape[-2:]
    ct = _compute_dtype(q)
    scale = 1.0 / math.sqrt(d)
    qs = q.to(ct) * scale  # (B, H, T, D)
    delta = (do.to(ct) * o.to(ct)).sum(dim=-1)  # (B, H, T)
    dq = torch.empty(q.shape, dtype=ct, device=q.device)  # (B, H, T, D), dS K: times 1/√D at the end
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)  # (B, H, T, D), dSᵀ (Q/√D)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)  # (B, H, T, D)
    for q0, q1, k0, k1 in _blocks(t, lo, hi, block):
        s = _scores(qs, k, q0, q1, k0, k1, lo, hi, ct)  # (B, H, q1−q0, k1−k0)
        p = s.sub_(lse[:, :, q0:q1, None]).exp_()  # (B, H, q1−q0, k1−k0)
        do_blk = do[:, :, q0:q1].to(ct)  # (B, H, q1−q0, D)
        dv[:, :, k0:k1] += p.transpose(-2, -1) @ do_blk
        dp = do_blk @ v[:, :, k0:k1].to(ct).transpose(-2, -1)  # (B, H, q1−q0, k1−k0)
        ds = dp.sub_(delta[:, :, q0:q1, None]).mul_(p)  # (B, H, q1−q0, k1−k0)
        torch.matmul(ds, k[:, :, k0:k1].to(ct), out=dq[:, :, q0:q1])
        dk[:, :, k0:k1] += ds.transpose(-2, -1) @ qs[:, :, q0:q1]
    return dq.mul_(scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _blocks(t, lo, hi, block):
    """(q0, q1, k0, k1) per query block [q0, q1): the keys [k0, k1) its band reaches."""
    for q0 in range(0, t, block):
        q1 = min(q0 + block, t)
        yield q0, q1, max(0, q0 + lo), min(t, q1 + hi)


def _scores(qs, k, q0, q1, k0, k1, lo, hi, ct):
    """S = (Q/√D) Kᵀ on one block, −∞ outside the band; (B, H, q1−q0, k1−k0) in dtype ct.

    Only the key columns near the band's edges, where some of the block's queries see the key and
    some do not, are masked: j < q1−1+lo (lower edge) and j > q0+hi (upper edge), ≤ 2 blocks wide.
    """
    s = qs[:, :, q0:q1] @ k[:, :, k0:k1].to(ct).transpose(-2, -1)  # (B, H, q1−q0, k1−k0)
    lower_end, upper_start = min(k1, q1 - 1 + lo), max(k0, q0 + hi + 1)
    edges = [(k0, k1)] if lower_end >= upper_start else [(k0, lower_end), (upper_start, k1)]
    rows = torch.arange(q0, q1, device=qs.device)[:, None]  # (q1−q0, 1)
    for c0, c1 in edges:
        if c0 < c1:
            offset = torch.arange(c0, c1, device=qs.device) - rows  # (q1−q0, c1−c0) key − query
            s[..., c0 - k0:c1 - k0].masked_fill_((offset < lo) | (offset > hi), float("-inf"))
    return s


def _compute_dtype(x):
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
