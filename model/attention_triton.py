"""FlashAttention-2 forward and backward as Triton kernels: the GPU path of model.attention.

Key j is visible to query i iff lo ≤ j − i ≤ hi (model.attention.band_limits). Per (batch, head),
with S = Q Kᵀ/√D (invisible entries −∞):
  forward   one program per query block, looping over key blocks with the online softmax:
              m ← max(m, rowmax S_blk),  ℓ ← ℓ·e^(m_old − m) + rowsum e^(S_blk − m),
              acc ← acc·e^(m_old − m) + e^(S_blk − m) V_blk;   O = acc/ℓ,  LSE = m + log ℓ
            O and LSE are all that is saved.
  backward  Δ_i = Σ_d dO_id O_id (preprocess kernel); P = exp(S − LSE) recomputed per block;
            dS = P ⊙ (dP − Δ) with dP = dO Vᵀ.
            dK, dV: one program per key block, looping over query blocks:
              dV += Pᵀ dO,  dK += dSᵀ Q/√D
            dQ: one program per query block, looping over key blocks:  dQ += dS K/√D
Exponentials are exp2 of scores pre-multiplied by log2(e)/√D, so the saved LSE is in base 2:
LSE₂ = log2 Σ_j 2^(S_ij·log2 e) = LSE·log2 e, and P = 2^(S·log2 e − LSE₂).

Every loop runs over the blocks the band can reach and no others; of those, only the blocks that
straddle an edge of the band or the end of the sequence are masked (`_band_blocks`). Matmuls
accumulate in float32; inputs are float32 (IEEE dot products), bfloat16 or float16. The head dim
is padded to a power of two inside the kernels with masked loads. Under TRITON_INTERPRET=1 the
same kernels run on CPU tensors with one small block size; on GPU the block sizes are autotuned
per (T, head dim, band, dtype).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read as triton.jit reads it, at import
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRET_BLOCK = 16
DELTA_BLOCK = 128

# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) candidates per kernel.
FWD_TUNING = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 4), (64, 32, 4, 4)]
DKDV_TUNING = [(32, 128, 4, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3)]
DQ_TUNING = [(128, 32, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3), (64, 64, 4, 3)]


def _configs(tuning):
    """Autotune candidates; a single small block under the interpreter, so nothing is benchmarked."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": INTERPRET_BLOCK, "BLOCK_N": INTERPRET_BLOCK})]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tuning]


@triton.jit
def _band_blocks(start, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr, T, lo, hi):
    """Inner blocks to visit for the outer rows [start, start + BLOCK_OUTER), where inner index c
    is visible to outer index r iff lo ≤ c − r ≤ hi and c < T (lo ≤ 0 ≤ hi).

    Returns first ≤ full_lo ≤ full_hi ≤ last: inner blocks in [full_lo, full_hi) lie wholly inside
    the band and the sequence and need no mask; [first, full_lo) and [full_hi, last) need one;
    everything outside [first, last) is skipped.
    """
    first = tl.maximum(start + lo, 0) // BLOCK_INNER * BLOCK_INNER
    last = tl.minimum(start + BLOCK_OUTER + hi, T)
    full_lo = (tl.maximum(start + BLOCK_OUTER - 1 + lo, first) + BLOCK_INNER - 1) // BLOCK_INNER * BLOCK_INNER
    full_lo = tl.minimum(full_lo, last)
    full_hi = tl.maximum(tl.minimum(start + hi + 1, T) // BLOCK_INNER * BLOCK_INNER, full_lo)
    return first, full_lo, full_hi, last


@triton.jit
def _visible(rows, cols, T, lo, hi):
    """(len(rows), len(cols)) mask: col c visible to row r iff lo ≤ c − r ≤ hi and c < T."""
    offset = cols[None, :] - rows[:, None]
    return (offset >= lo) & (offset <= hi) & (cols[None, :] < T)


@triton.jit
def _load_tile(ptr, rows, stride, cols, T,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """(len(rows), BLOCK_D) tile of a row-major (T, HEAD_DIM) matrix, zero outside it."""
    ptrs = ptr + rows[:, None] * stride + cols[None, :]
    if CHECK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < T) & (cols[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM < BLOCK_D:
        tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _store_tile(ptr, rows, stride, cols, tile, T, HEAD_DIM: tl.constexpr):
    mask = (rows[:, None] < T) & (cols[None, :] < HEAD_DIM)
    tl.store(ptr + rows[:, None] * stride + cols[None, :], tile, mask=mask)


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, K, V, skt, svt, rows, cols, first, stop, T, lo, hi, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """Online-softmax update of (acc, m, ℓ) over key blocks [first, stop); scores in log2 units."""
    for start_n in range(first, stop, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, keys, skt, cols, T, HEAD_DIM, BLOCK_D, MASKED)  # (BLOCK_N, BLOCK_D)
        v = _load_tile(V, keys, svt, cols, T, HEAD_DIM, BLOCK_D, MASKED)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            s = tl.where(_visible(rows, keys, T, lo, hi), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
        p = tl.math.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_new)  # (BLOCK_M,)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.autotune(configs=_configs(FWD_TUNING), key=["T", "HEAD_DIM", "lo", "hi"])
@triton.jit
def _fwd_kernel(Q, K, V, Out, LSE, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                H, T, lo, hi, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    Q += b * sqb + h * sqh
    K += b * skb + h * skh
    V += b * svb + h * svh
    Out += b * sob + h * soh
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    q = _load_tile(Q, rows, sqt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    # Finite start: a row whose first blocks are all masked keeps m finite and ℓ = 0, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first, full_lo, full_hi, last = _band_blocks(start_m, BLOCK_M, BLOCK_N, T, lo, hi)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, skt, svt, rows, cols, first, full_lo, T, lo, hi,
                               qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, True)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, skt, svt, rows, cols, full_lo, full_hi, T, lo, hi,
                               qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, False)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, skt, svt, rows, cols, full_hi, last, T, lo, hi,
                               qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, True)
    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # only rows past T see no key
    _store_tile(Out, rows, sot, cols, (acc / l_i[:, None]).to(Out.dtype.element_ty), T, HEAD_DIM)
    tl.store(LSE + bh * T + rows, m_i + tl.math.log2(l_i), mask=rows < T)


@triton.jit
def _delta_kernel(Out, DO, DELTA, sob, soh, sot, sdb, sdh, sdt, H, T,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Δ_i = Σ_d dO_id O_id in float32."""
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    o = _load_tile(Out + b * sob + h * soh, rows, sot, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    do = _load_tile(DO + b * sdb + h * sdh, rows, sdt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    tl.store(DELTA + bh * T + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < T)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqt, sdt, keys, cols, first, stop, T, lo, hi, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate dV += Pᵀ dO and dK += dSᵀ Q (unscaled) over query blocks [first, stop)."""
    for start_m in range(first, stop, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(Q, rows, sqt, cols, T, HEAD_DIM, BLOCK_D, MASKED)  # (BLOCK_M, BLOCK_D)
        do = _load_tile(DO, rows, sdt, cols, T, HEAD_DIM, BLOCK_D, MASKED)  # (BLOCK_M, BLOCK_D)
        if MASKED:
            lse = tl.load(LSE + rows, mask=rows < T, other=0.0)  # (BLOCK_M,)
            delta = tl.load(DELTA + rows, mask=rows < T, other=0.0)  # (BLOCK_M,)
        else:
            lse = tl.load(LSE + rows)
            delta = tl.load(DELTA + rows)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t - lse[None, :])  # (BLOCK_N, BLOCK_M)
        if MASKED:  # query i sees key j iff lo ≤ j − i ≤ hi, i.e. −hi ≤ i − j ≤ −lo
            p_t = tl.where(_visible(keys, rows, T, -hi, -lo), p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])  # (BLOCK_N, BLOCK_M)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=_configs(DKDV_TUNING), key=["T", "HEAD_DIM", "lo", "hi"])
@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
                 sdb, sdh, sdt, sgb, sgh, sgt, H, T, lo, hi, sm_scale, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV for one key block; DK and DV share the strides (sgb, sgh, sgt)."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    Q += b * sqb + h * sqh
    DO += b * sdb + h * sdh
    LSE += bh * T
    DELTA += bh * T
    keys = start_n + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    k = _load_tile(K + b * skb + h * skh, keys, skt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_N, BLOCK_D)
    v = _load_tile(V + b * svb + h * svh, keys, svt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first, full_lo, full_hi, last = _band_blocks(start_n, BLOCK_N, BLOCK_M, T, -hi, -lo)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqt, sdt, keys, cols, first, full_lo, T, lo, hi,
                         qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_PRECISION, True)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqt, sdt, keys, cols, full_lo, full_hi, T, lo, hi,
                         qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_PRECISION, False)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqt, sdt, keys, cols, full_hi, last, T, lo, hi,
                         qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_PRECISION, True)
    grad_offset = b * sgb + h * sgh
    _store_tile(DK + grad_offset, keys, sgt, cols, (dk * sm_scale).to(DK.dtype.element_ty), T, HEAD_DIM)
    _store_tile(DV + grad_offset, keys, sgt, cols, dv.to(DV.dtype.element_ty), T, HEAD_DIM)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, rows, cols, first, stop, T, lo, hi, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate dQ += dS K (unscaled) over key blocks [first, stop)."""
    for start_n in range(first, stop, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, keys, skt, cols, T, HEAD_DIM, BLOCK_D, MASKED)  # (BLOCK_N, BLOCK_D)
        v = _load_tile(V, keys, svt, cols, T, HEAD_DIM, BLOCK_D, MASKED)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            p = tl.where(_visible(rows, keys, T, lo, hi), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])  # (BLOCK_M, BLOCK_N)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.autotune(configs=_configs(DQ_TUNING), key=["T", "HEAD_DIM", "lo", "hi"])
@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
               sdb, sdh, sdt, sgb, sgh, sgt, H, T, lo, hi, sm_scale, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ for one query block."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    K += b * skb + h * skh
    V += b * svb + h * svh
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * sqb + h * sqh, rows, sqt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    do = _load_tile(DO + b * sdb + h * sdh, rows, sdt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=0.0)  # (BLOCK_M,)
    delta = tl.load(DELTA + bh * T + rows, mask=rows < T, other=0.0)  # (BLOCK_M,)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first, full_lo, full_hi, last = _band_blocks(start_m, BLOCK_M, BLOCK_N, T, lo, hi)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, rows, cols, first, full_lo, T, lo, hi, qk_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, True)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, rows, cols, full_lo, full_hi, T, lo, hi, qk_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, False)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, rows, cols, full_hi, last, T, lo, hi, qk_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, True)
    _store_tile(DQ + b * sgb + h * sgh, rows, sgt, cols, (dq * sm_scale).to(DQ.dtype.element_ty), T, HEAD_DIM)


def banded_attention(q, k, v, lo: int, hi: int):
    """softmax(QKᵀ/√D + band mask) V for q, k, v of shape (B, H, T, D); differentiable once."""
    if not (q.shape == k.shape == v.shape) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share shape (B, H, T, D) and dtype; got {q.shape}, {k.shape}, "
                         f"{v.shape} and {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in DTYPES:
        raise ValueError(f"impl='triton' takes {[str(d) for d in DTYPES]}, not {q.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"impl='triton' takes head dims up to {MAX_HEAD_DIM}, not {q.shape[-1]}")
    if not q.is_cuda and not INTERPRET:
        raise ValueError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported")
    return _FlashAttention.apply(q, k, v, lo, hi)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lo, hi):
        q, k, v = (_unit_stride(x) for x in (q, k, v))
        b, h, t, d = q.shape
        o = torch.empty(b, h, t, d, dtype=q.dtype, device=q.device)  # (B, H, T, D)
        lse = torch.empty(b, h, t, dtype=torch.float32, device=q.device)  # (B, H, T)
        grid = lambda meta: (triton.cdiv(t, meta["BLOCK_M"]), b * h)  # noqa: E731
        with _device_of(q):
            _fwd_kernel[grid](q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                              h, t, lo, hi, LOG2E / math.sqrt(d), **_shape_args(q))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.band = (lo, hi)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        lo, hi = ctx.band
        do = _unit_stride(do)
        b, h, t, d = q.shape
        shape_args = _shape_args(q)
        delta = torch.empty_like(lse)  # (B, H, T)
        dq, dk, dv = (torch.empty_like(o) for _ in range(3))  # (B, H, T, D), contiguous like o
        delta_block = INTERPRET_BLOCK if INTERPRET else DELTA_BLOCK
        common = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
                  h, t, lo, hi, 1.0 / math.sqrt(d), LOG2E / math.sqrt(d))
        kv_grid = lambda meta: (triton.cdiv(t, meta["BLOCK_N"]), b * h)  # noqa: E731
        q_grid = lambda meta: (triton.cdiv(t, meta["BLOCK_M"]), b * h)  # noqa: E731
        with _device_of(q):
            _delta_kernel[(triton.cdiv(t, delta_block), b * h)](
                o, do, delta, *_strides(o), *_strides(do), h, t,
                HEAD_DIM=d, BLOCK_D=shape_args["BLOCK_D"], BLOCK_M=delta_block)
            _dkdv_kernel[kv_grid](q, k, v, do, lse, delta, dk, dv, *common, **shape_args)
            _dq_kernel[q_grid](q, k, v, do, lse, delta, dq, *common, **shape_args)
        return dq, dk, dv, None, None


def _shape_args(q):
    """Compile-time arguments shared by the kernels: head dim, its power-of-two padding, dot precision."""
    d = q.shape[-1]
    return {
        "HEAD_DIM": d,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


def _strides(x):
    """(batch, head, time) strides of a (B, H, T, D) tensor whose last stride is 1."""
    return x.stride(0), x.stride(1), x.stride(2)


def _device_of(x):
    """Launch on x's GPU even when another one is current; nothing to select for CPU tensors."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _unit_stride(x):
    return x if x.stride(-1) == 1 else x.contiguous()
