"""FlashAttention-2 forward and fused backward as Triton kernels: the GPU path of model.attention.

Key j is visible to query i iff lo ≤ j − i ≤ hi (model.attention.band_limits). Per (batch, head),
with S = Q Kᵀ/√D (invisible entries −∞), A = softmax(S) row-wise, O = A V, dO = ∂F/∂O:

forward, one program per query block, looping over the key blocks its band reaches, with the
online softmax (m: running row max, ℓ: running row sum, acc: unnormalised output):
    m' = max(m, rowmax S_blk),  ℓ ← ℓ·e^(m − m') + rowsum e^(S_blk − m'),
    acc ← acc·e^(m − m') + e^(S_blk − m') V_blk,  m ← m';      O = acc/ℓ,  LSE = m + log ℓ.
  O and LSE are all that is saved: memory O(T·D), never O(T²).

backward, derived from O = A V with A = softmax(S):
    dV = Aᵀ dO                                     (O is linear in V)
    dA = dO Vᵀ                                     (dP below: the gradient reaching A)
    dS = A ⊙ (dA − Δ),  Δ_i = Σ_j A_ij dA_ij       (the softmax Jacobian, row by row)
  and Δ_i = Σ_j A_ij (dO_i · V_j) = dO_i · Σ_j A_ij V_j = dO_i · O_i, so Δ = rowsum(dO ⊙ O) needs
  no T×T matrix. Finally S = Q Kᵀ/√D gives dQ = dS K/√D and dK = dSᵀ Q/√D.
  A is recomputed tile by tile from the saved LSE: A_ij = e^(S_ij − LSE_i), already normalised.
  Launches: (1) a preprocess kernel computes Δ and zeroes a float32 dQ accumulator; (2) one fused
  kernel, one program per key block, loops over the query blocks that see it and does five
  matmuls per tile, FlashAttention-2's split:
      Sᵀ = K Qᵀ,  Pᵀ = e^(Sᵀ − LSE),  dV += Pᵀ dO,  dPᵀ = V dOᵀ,  dSᵀ = Pᵀ ⊙ (dPᵀ − Δ),
      dK += dSᵀ Q,  dQ_tile = dS K  → added atomically into the accumulator (other key blocks'
  programs add into the same rows); (3) the accumulator is cast into dQ, in place in the packed
  dQKV buffer when q, k, v came from one fused projection (see `banded_attention`). The float32
  atomic sums make dQ's last bits depend on the order programs finish: it is not bit-reproducible
  from run to run, as in FlashAttention-2.
  Deterministic mode (`deterministic=True`) trades that for one more pass: (1) the preprocess
  computes Δ only; (2) the same key-block kernel computes dK and dV alone (four matmuls per tile,
  no dQ, no atomics); (3) a dQ kernel, one program per query block, loops over the key blocks its
  band reaches like the forward and recomputes three matmuls per tile,
      S = Q Kᵀ,  P = e^(S − LSE),  dP = dO Vᵀ,  dS = P ⊙ (dP − Δ),  dQ += dS K,
  writing dQ once, in q's dtype. Every output element is then summed by one program in a fixed
  order: the gradients are the same bits on every run (the recomputed S and dP cost two matmuls
  per tile more than the atomic form's five).

Exponentials are exp2 with log2(e) folded into the scale, and each costs one fused multiply-add
before the exp2: with c = log2(e)/√D the forward keeps m in units of c·S and computes
e^(S − m) = 2^(QKᵀ·c − m₂) as fma(QKᵀ, c, −m₂); the saved LSE is in base 2, LSE₂ = LSE·log2(e),
and the backward's A = 2^(QKᵀ·c − LSE₂). The raw scores QKᵀ are never scaled on their own.

Every loop runs over the blocks the band can reach and no others (`_band_blocks`). Inner blocks
visible to every row of the outer block run unmasked, in whole inner blocks; the rest (the strips
along the band's edges, such as the causal diagonal and a window's lower edge, and the sequence's
end) run masked, in sub-blocks of MASK_* (half an inner block in most configs). A masked strip is
then at most one outer block plus one sub-block wide instead of plus one inner block, so the
autotuner can pick large inner blocks for the unmasked bulk without paying for them along the
edges (on an aligned causal diagonal the strip is the outer block's square either way). The
backward's masked tiles also mask the keys past T, its outer rows: they load as zeros, and their
recomputed Aᵀ = 2^(0 − LSE₂) overflows for a query whose LSE is very negative (queries pointing away
from every key), then inf · 0 = NaN reaches dQ. So the one key block that reaches past T (T not a
multiple of BLOCK_N) runs all its tiles masked; every other program keeps its unmasked bulk.
(Queries past T, the forward's and dQ pass's outer rows, are never stored and need no mask.)
Masking sets the exponent to −∞ before the exp2, so nothing overflows even in masked entries. Matmuls accumulate in float32; inputs are bfloat16 or float16 on
a GPU, float32 or float16 under the interpreter (whose tl.dot has no bfloat16). The head dim is
padded to a power of two inside the kernels with masked loads.

Hopper (HOPPER, `_hopper_path`: sm_90 and newer, and tensors a TMA descriptor can take): the outer
tile (a program's queries, or keys and values) is loaded once through pointers, rows past T masked;
the unmasked inner loops, the bulk of the work, read their tiles through TMA tensor descriptors, one
per (batch, head) matrix, built on the device, whose loads are asynchronous bulk copies into shared
memory that the software pipeliner overlaps with the matmuls of earlier tiles, with no address
arithmetic in registers. Masked loops step in sub-blocks that no descriptor's block shape fits and
keep pointer loads. Every matmul is a wgmma: the atomic backward computes its dQ share transposed,
dQᵀ = Kᵀ dSᵀ, so that the product has BLOCK_D ≥ 64 rows (a wgmma needs 64 per warpgroup) whatever
the query block. Elsewhere (older GPUs, other strides) every load goes through pointers and dQ is
dS K, an mma.sync of any height, which takes fewer registers there.

Tuning (model/attention_configs.py): each program's block sizes are autotuned per (bucket of T, band
width, head dim, dtype): T is rounded up to a power of two and the band to its width, capped by
that bucket, so new sequence lengths reuse a tuned choice instead of benchmarking every config
again. Each kernel has its candidates (FWD_TUNING; BWD_TUNING for both key-block kernels; DQ_TUNING
for the deterministic dQ pass), which depend on the head dim (larger tiles fit at 64);
tests/model/test_attention_compile.py compiles every one ahead of time, on the CPU, for sm_90 at the
head dims it serves (64–128), in bf16, and TABLE's choices for sm_80 too: no register spills. Set
GPT3D_TRITON_AUTOTUNE=0 (before import) to run the committed TABLE instead, one config per kernel,
head dim and T bucket, with no benchmarking. A run records what the autotuner chose in its
checkpoints and a resumed process pins those choices (`autotuners`, model/kernel_choices.py), so its
kernels sum in the same order as before.
Under TRITON_INTERPRET=1 the same kernels run on CPU tensors with small fixed blocks, on the Hopper
path (or the other one: INTERPRET_HOPPER = False).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from model.attention_configs import KERNELS, candidates, chosen, table_entries

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read as triton.jit reads it, at import
AUTOTUNE = os.environ.get("GPT3D_TRITON_AUTOTUNE", "1") != "0"
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
# On a GPU the kernels take half precision only: float32 operands would need IEEE dot products,
# which Triton builds from scalar FMAs that spill at every block size worth running. Under the
# interpreter float32 is kept, for tests against float64, and bfloat16 is refused: the interpreter's
# tl.dot has no bfloat16 and returns products wrong by orders of magnitude, without an error.
DTYPES = (torch.bfloat16, torch.float16)
INTERPRET_DTYPES = (torch.float32, torch.float16)
PREPROCESS_BLOCK = 64

# Under the interpreter: inner blocks twice the outer, split in two when masked, so every test
# crosses outer, inner and masked sub-block boundaries at small T.
INTERPRET_FWD = (16, 32, 16)
INTERPRET_BWD = (32, 16, 16)
# Under the interpreter the kernels run the Hopper path (`_hopper_path`); tests set it False to run
# the other one, older GPUs'.
INTERPRET_HOPPER = True

TUNING_KEY = ["T_TUNE", "BAND_TUNE", "HEAD_DIM"]  # the autotuner also keys on the tensors' dtypes
# Integer arguments Triton would otherwise specialise on (value 1, multiple of 16), compiling one
# variant per residue of T, lo and hi; the strides stay specialised (aligned, vectorised loads).
NO_SPECIALIZE = ["T", "lo", "hi", "T_TUNE", "BAND_TUNE"]


def triton_configs(entries, mask_name: str) -> list:
    """triton.Configs from (BLOCK_M, BLOCK_N, mask sub-block, num_warps, num_stages) entries;
    mask_name: "MASK_N" (forward, dQ pass) or "MASK_M" (key-block backward)."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, mask_name: mask}, num_warps=w, num_stages=s)
            for m, n, mask, w, s in entries]


def _entry(config, mask_name: str) -> tuple:
    return (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs[mask_name], config.num_warps,
            config.num_stages)


def _autotuned(kernel: str, interpret_blocks):
    """triton.autotune for one kernel of KERNELS (model/attention_configs.py): the interpreter's one
    small config; else, with autotuning, every candidate of its lists, narrowed per call to the head
    dim's list; without, TABLE's entries, narrowed per call to the one for (head dim, T bucket), which
    the autotuner then runs without benchmarking."""
    tuning, mask_name = KERNELS[kernel]
    if INTERPRET:
        configs = [triton.Config(dict(zip(("BLOCK_M", "BLOCK_N", mask_name), interpret_blocks)))]
    elif AUTOTUNE:
        configs = triton_configs(list(dict.fromkeys(e for entries in tuning.values() for e in entries)), mask_name)
    else:
        configs = triton_configs(table_entries(kernel), mask_name)

    def prune(configs, named_args, **kwargs):
        head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        if AUTOTUNE:
            wanted = set(candidates(tuning, head_dim))
        else:
            wanted = {chosen(kernel, head_dim, kwargs.get("T_TUNE", named_args.get("T_TUNE")))}
        return [c for c in configs if _entry(c, mask_name) in wanted]

    return triton.autotune(configs=configs, key=TUNING_KEY, prune_configs_by={"early_config_prune": prune},
                           reset_to_zero=["DQ"] if kernel == "backward" else None)


def tuning_key(t: int, lo: int, hi: int) -> tuple[int, int]:
    """(T bucket, band width) the block sizes are tuned for: T rounded up to a power of two; the
    number of key offsets the band admits, a side that reaches past the sequence counted as the bucket."""
    bucket = triton.next_power_of_2(t)
    lo_key = lo if lo > -t else -bucket
    hi_key = hi if hi < t else bucket
    return bucket, hi_key - lo_key + 1


@triton.jit
def _band_blocks(start, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr, MASK_INNER: tl.constexpr,
                 T, lo, hi):
    """Inner index ranges to visit for the outer rows [start, start + BLOCK_OUTER), where inner
    index c is visible to outer row r iff lo ≤ c − r ≤ hi and c < T (lo ≤ 0 ≤ hi).

    Returns first ≤ full_lo ≤ full_hi ≤ last (up to the overshoot of a last sub-block):
      [full_lo, full_hi)  inner indices visible to every outer row: no mask, whole BLOCK_INNER steps;
      [first, full_lo), [full_hi, last)  the band's edges and the sequence's end: masked, in
                          MASK_INNER steps; everything outside [first, last) is skipped.
    Every visible (r, c) has c ≥ start + lo and c ≤ start + BLOCK_OUTER − 1 + hi, so it lies in
    [first, last); c ≥ start + BLOCK_OUTER − 1 + lo and c ≤ start + hi, c < T make (r, c) visible
    for every r in the block.
    """
    first = tl.maximum(start + lo, 0) // MASK_INNER * MASK_INNER
    last = tl.minimum(start + BLOCK_OUTER + hi, T)
    full_lo = (tl.maximum(start + BLOCK_OUTER - 1 + lo, first) + MASK_INNER - 1) // MASK_INNER * MASK_INNER
    full_lo = tl.minimum(full_lo, last)
    full_hi = tl.maximum(tl.minimum(start + hi + 1, T) // MASK_INNER * MASK_INNER, full_lo)
    full_hi = full_lo + (full_hi - full_lo) // BLOCK_INNER * BLOCK_INNER  # the rest joins the masked edge
    return first, full_lo, full_hi, last


@triton.jit
def _visible(rows, cols, T, lo, hi):
    """(len(rows), len(cols)) mask: col c visible to row r iff lo ≤ c − r ≤ hi and c < T."""
    offset = cols[None, :] - rows[:, None]
    return (offset >= lo) & (offset <= hi) & (cols[None, :] < T)


@triton.jit
def _load_tile(ptr, rows, stride, cols, T,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """(len(rows), BLOCK_D) tile of a (T, HEAD_DIM) matrix with row stride `stride`, zero outside it."""
    ptrs = ptr + rows[:, None] * stride + cols[None, :]
    if CHECK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < T) & (cols[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM < BLOCK_D:
        tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _tile_source(ptr, stride, T, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                 HOPPER: tl.constexpr):
    """Where an unmasked loop reads (BLOCK, BLOCK_D) tiles of the (T, HEAD_DIM) matrix at ptr (row
    stride `stride`): on HOPPER a tensor descriptor, whose loads are TMA bulk copies on sm_90 that
    fill rows past T and columns past HEAD_DIM with zeros; otherwise ptr itself, for `_load_tile`."""
    if HOPPER:
        source = tl.make_tensor_descriptor(ptr, shape=[T, HEAD_DIM], strides=[stride, 1], block_shape=[BLOCK, BLOCK_D])
    else:
        source = ptr
    return source


@triton.jit
def _load_inner(ptr, source, start, rows, stride, cols, T, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                MASKED: tl.constexpr, HOPPER: tl.constexpr):
    """The (len(rows), BLOCK_D) tile at rows = start + arange of an inner loop: through the tensor
    descriptor `source` in unmasked loops on HOPPER, otherwise `_load_tile` (rows checked against
    T where MASKED: the masked loops step in sub-blocks the descriptor's block shape does not fit)."""
    if HOPPER and not MASKED:
        tile = source.load([start, 0])
    else:
        tile = _load_tile(ptr, rows, stride, cols, T, HEAD_DIM, BLOCK_D, MASKED)
    return tile


@triton.jit
def _store_tile(ptr, rows, stride, cols, tile, T, HEAD_DIM: tl.constexpr):
    mask = (rows[:, None] < T) & (cols[None, :] < HEAD_DIM)
    tl.store(ptr + rows[:, None] * stride + cols[None, :], tile, mask=mask)


@triton.jit
def _add_tile(ptr, rows, stride, cols, tile, T,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Atomically add a float32 tile into the rows `rows` of a (T, HEAD_DIM) matrix, the tile given as
    (len(rows), BLOCK_D), or TRANSPOSED as (BLOCK_D, len(rows)); only the sum's order is unordered."""
    if TRANSPOSED:
        r, c = rows[None, :], cols[:, None]
    else:
        r, c = rows[:, None], cols[None, :]
    ptrs = ptr + r * stride + c
    if CHECK_ROWS:
        tl.atomic_add(ptrs, tile, mask=(r < T) & (c < HEAD_DIM), sem="relaxed")
    elif HEAD_DIM < BLOCK_D:
        tl.atomic_add(ptrs, tile, mask=c < HEAD_DIM, sem="relaxed")
    else:
        tl.atomic_add(ptrs, tile, sem="relaxed")


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, K, V, k_src, v_src, skt, svt, rows, cols, first, stop, T, lo, hi, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
               DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, HOPPER: tl.constexpr):
    """Online-softmax update of (acc, m, ℓ) over key blocks [first, stop) of BLOCK keys; m in c·S units.
    k_src, v_src: `_tile_source` of K and V (read by unmasked loops)."""
    for start_n in range(first, stop, BLOCK):
        keys = start_n + tl.arange(0, BLOCK)
        k = _load_inner(K, k_src, start_n, keys, skt, cols, T, HEAD_DIM, BLOCK_D, MASKED, HOPPER)  # (BLOCK, BLOCK_D)
        v = _load_inner(V, v_src, start_n, keys, svt, cols, T, HEAD_DIM, BLOCK_D, MASKED, HOPPER)  # (BLOCK, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK), raw Q Kᵀ
        if MASKED:
            qk = tl.where(_visible(rows, keys, T, lo, hi), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (BLOCK_M,); qk_scale > 0 commutes with max
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # (BLOCK_M, BLOCK), one FMA then exp2
        alpha = tl.math.exp2(m_i - m_new)  # (BLOCK_M,)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@_autotuned("forward", INTERPRET_FWD)
@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _fwd_kernel(Q, K, V, Out, LSE, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                H, T, lo, hi, qk_scale, T_TUNE, BAND_TUNE,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, HOPPER: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr):
    """O and LSE₂ for one query block. Grid (B·H, query blocks), last query block first: under a
    causal mask it has the most keys, and starting the longest programs first shortens the tail.
    T_TUNE and BAND_TUNE only key the autotuner (`tuning_key`)."""
    bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
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
    k_src = _tile_source(K, skt, T, HEAD_DIM, BLOCK_N, BLOCK_D, HOPPER)
    v_src = _tile_source(V, svt, T, HEAD_DIM, BLOCK_N, BLOCK_D, HOPPER)
    first, full_lo, full_hi, last = _band_blocks(start_m, BLOCK_M, BLOCK_N, MASK_N, T, lo, hi)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, k_src, v_src, skt, svt, rows, cols, first, full_lo, T, lo,
                               hi, qk_scale, HEAD_DIM, BLOCK_D, MASK_N, DOT_PRECISION, True, HOPPER)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, k_src, v_src, skt, svt, rows, cols, full_lo, full_hi, T, lo,
                               hi, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, False, HOPPER)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, k_src, v_src, skt, svt, rows, cols, full_hi, last, T, lo,
                               hi, qk_scale, HEAD_DIM, BLOCK_D, MASK_N, DOT_PRECISION, True, HOPPER)
    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # only rows past T see no key
    _store_tile(Out, rows, sot, cols, (acc / l_i[:, None]).to(Out.dtype.element_ty), T, HEAD_DIM)
    tl.store(LSE + bh * T + rows, m_i + tl.math.log2(l_i), mask=rows < T)


@triton.jit(do_not_specialize=["T"])
def _bwd_preprocess(Out, DO, DELTA, DQ, sob, soh, sot, sdb, sdh, sdt, sqb, sqh, sqt, H, T,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr):
    """Δ_i = Σ_d dO_id O_id in float32; with ZERO_DQ, also the float32 dQ accumulator's rows set to zero
    (the atomic backward adds into it; the deterministic one passes DQ unused)."""
    bh = tl.program_id(0)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    o = _load_tile(Out + b * sob + h * soh, rows, sot, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    do = _load_tile(DO + b * sdb + h * sdh, rows, sdt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    tl.store(DELTA + bh * T + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < T)
    if ZERO_DQ:
        _store_tile(DQ + b * sqb + h * sqh, rows, sqt, cols, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), T, HEAD_DIM)


@triton.jit
def _bwd_inner(dk, dv, k, v, Q, DO, q_src, do_src, DQ, LSE, DELTA, sqt, sdt, sdqt, keys, cols, first, stop, T, lo,
               hi, sm_scale, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
               DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr, HOPPER: tl.constexpr):
    """For query blocks [first, stop) of BLOCK rows: dV += Pᵀ dO, dK += dSᵀ Q (unscaled), and with
    ATOMIC_DQ dQ_rows += dS K/√D added atomically (five matmuls per tile; four without). The
    transposed tiles keep keys as rows. q_src, do_src: `_tile_source` of Q and dO."""
    for start_m in range(first, stop, BLOCK):
        rows = start_m + tl.arange(0, BLOCK)
        q = _load_inner(Q, q_src, start_m, rows, sqt, cols, T, HEAD_DIM, BLOCK_D, MASKED, HOPPER)  # (BLOCK, BLOCK_D)
        do = _load_inner(DO, do_src, start_m, rows, sdt, cols, T, HEAD_DIM, BLOCK_D, MASKED, HOPPER)  # (BLOCK, BLOCK_D)
        if MASKED:
            lse = tl.load(LSE + rows, mask=rows < T, other=0.0)  # (BLOCK,)
            delta = tl.load(DELTA + rows, mask=rows < T, other=0.0)  # (BLOCK,)
        else:
            lse = tl.load(LSE + rows)
            delta = tl.load(DELTA + rows)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK), raw K Qᵀ
        s_t = qk_t * qk_scale - lse[None, :]  # (BLOCK_N, BLOCK), one FMA: log2 Pᵀ
        if MASKED:  # query i sees key j iff lo ≤ j − i ≤ hi, i.e. −hi ≤ i − j ≤ −lo; and keys past T none
            s_t = tl.where(_visible(keys, rows, T, -hi, -lo) & (keys[:, None] < T), s_t, float("-inf"))
        p_t = tl.math.exp2(s_t)  # (BLOCK_N, BLOCK)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)  # (BLOCK_N, BLOCK)
        dk += tl.dot(ds_t, q, input_precision=DOT_PRECISION)
        if ATOMIC_DQ and HOPPER:  # dQᵀ = Kᵀ dSᵀ: BLOCK_D ≥ 64 rows, a wgmma even where BLOCK is 16 or 32
            dq_t = tl.dot(tl.trans(k), ds_t, input_precision=DOT_PRECISION)  # (BLOCK_D, BLOCK)
            _add_tile(DQ, rows, sdqt, cols, dq_t * sm_scale, T, HEAD_DIM, BLOCK_D, MASKED, True)
        elif ATOMIC_DQ:  # dQ = dS K: fewer registers where the product is an mma.sync of any height
            dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION)  # (BLOCK, BLOCK_D)
            _add_tile(DQ, rows, sdqt, cols, dq * sm_scale, T, HEAD_DIM, BLOCK_D, MASKED, False)
    return dk, dv


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _bwd_kv(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
            sdb, sdh, sdt, sdqb, sdqh, sdqt, sgb, sgh, sgt, H, T, lo, hi, sm_scale, qk_scale, T_TUNE, BAND_TUNE,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, HOPPER: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_M: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """dK, dV of one key block and, with ATOMIC_DQ, its share of dQ (float32, added into DQ; unused
    without). DK and DV share the strides (sgb, sgh, sgt). Grid (B·H, key blocks); under a causal
    mask the first key blocks, seen by the most queries, are the longest programs and already start first."""
    bh = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    Q += b * sqb + h * sqh
    DO += b * sdb + h * sdh
    DQ += b * sdqb + h * sdqh
    LSE += bh * T
    DELTA += bh * T
    keys = start_n + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    k = _load_tile(K + b * skb + h * skh, keys, skt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_N, BLOCK_D)
    v = _load_tile(V + b * svb + h * svh, keys, svt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # query i sees key j iff −hi ≤ i − j ≤ −lo: the band seen from the keys' side
    first, full_lo, full_hi, last = _band_blocks(start_n, BLOCK_N, BLOCK_M, MASK_M, T, -hi, -lo)
    # A key block reaching past T has no query tile visible to all its keys: every tile is masked
    # (the keys past T load as zeros; unmasked, their Pᵀ = 2^(0 − LSE₂) overflows where a query's
    # LSE is very negative, and inf · 0 reaches dQ). Only this one program of the grid pays for it.
    full_hi = tl.where(start_n + BLOCK_N > T, full_lo, full_hi)
    q_src = _tile_source(Q, sqt, T, HEAD_DIM, BLOCK_M, BLOCK_D, HOPPER)
    do_src = _tile_source(DO, sdt, T, HEAD_DIM, BLOCK_M, BLOCK_D, HOPPER)
    dk, dv = _bwd_inner(dk, dv, k, v, Q, DO, q_src, do_src, DQ, LSE, DELTA, sqt, sdt, sdqt, keys, cols, first,
                        full_lo, T, lo, hi, sm_scale, qk_scale, HEAD_DIM, BLOCK_D, MASK_M, DOT_PRECISION, True,
                        ATOMIC_DQ, HOPPER)
    dk, dv = _bwd_inner(dk, dv, k, v, Q, DO, q_src, do_src, DQ, LSE, DELTA, sqt, sdt, sdqt, keys, cols, full_lo,
                        full_hi, T, lo, hi, sm_scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_PRECISION, False,
                        ATOMIC_DQ, HOPPER)
    dk, dv = _bwd_inner(dk, dv, k, v, Q, DO, q_src, do_src, DQ, LSE, DELTA, sqt, sdt, sdqt, keys, cols, full_hi,
                        last, T, lo, hi, sm_scale, qk_scale, HEAD_DIM, BLOCK_D, MASK_M, DOT_PRECISION, True,
                        ATOMIC_DQ, HOPPER)
    grad_offset = b * sgb + h * sgh
    _store_tile(DK + grad_offset, keys, sgt, cols, (dk * sm_scale).to(DK.dtype.element_ty), T, HEAD_DIM)
    _store_tile(DV + grad_offset, keys, sgt, cols, dv.to(DV.dtype.element_ty), T, HEAD_DIM)


# One kernel, two tuned launches: with ATOMIC_DQ (the default backward; the autotuner zeroes the dQ
# accumulator between its trial runs) and without (the deterministic backward's dK, dV pass).
_bwd_kernel = _autotuned("backward", INTERPRET_BWD)(_bwd_kv)
_bwd_kv_kernel = _autotuned("backward_kv", INTERPRET_BWD)(_bwd_kv)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, K, V, k_src, v_src, skt, svt, rows, cols, first, stop, T, lo, hi, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
              DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, HOPPER: tl.constexpr):
    """dQ_rows += dS K (unscaled) over key blocks [first, stop) of BLOCK keys, with P = 2^(QKᵀ·c − LSE₂),
    dP = dO Vᵀ and dS = P ⊙ (dP − Δ) recomputed per tile: three matmuls, no atomics. k_src, v_src:
    `_tile_source` of K and V."""
    for start_n in range(first, stop, BLOCK):
        keys = start_n + tl.arange(0, BLOCK)
        k = _load_inner(K, k_src, start_n, keys, skt, cols, T, HEAD_DIM, BLOCK_D, MASKED, HOPPER)  # (BLOCK, BLOCK_D)
        v = _load_inner(V, v_src, start_n, keys, svt, cols, T, HEAD_DIM, BLOCK_D, MASKED, HOPPER)  # (BLOCK, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK), raw Q Kᵀ
        s = qk * qk_scale - lse[:, None]  # (BLOCK_M, BLOCK), one FMA: log2 P
        if MASKED:
            s = tl.where(_visible(rows, keys, T, lo, hi), s, float("-inf"))
        p = tl.math.exp2(s)  # (BLOCK_M, BLOCK)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK)
        ds = (p * (dp - delta[:, None])).to(k.dtype)  # (BLOCK_M, BLOCK)
        dq += tl.dot(ds, k, input_precision=DOT_PRECISION)
    return dq


@_autotuned("backward_dq", INTERPRET_FWD)
@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                   sdqb, sdqh, sdqt, H, T, lo, hi, sm_scale, qk_scale, T_TUNE, BAND_TUNE,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, HOPPER: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr):
    """dQ = dS K/√D of one query block, summed in one program in key order and stored once in DQ's
    dtype: the deterministic backward's dQ. Grid (B·H, query blocks), last query block first, as the
    forward (under a causal mask it sees the most keys)."""
    bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    K += b * skb + h * skh
    V += b * svb + h * svh
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * sqb + h * sqh, rows, sqt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    do = _load_tile(DO + b * sdb + h * sdh, rows, sdt, cols, T, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=0.0)  # (BLOCK_M,), base 2
    delta = tl.load(DELTA + bh * T + rows, mask=rows < T, other=0.0)  # (BLOCK_M,)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_src = _tile_source(K, skt, T, HEAD_DIM, BLOCK_N, BLOCK_D, HOPPER)
    v_src = _tile_source(V, svt, T, HEAD_DIM, BLOCK_N, BLOCK_D, HOPPER)
    first, full_lo, full_hi, last = _band_blocks(start_m, BLOCK_M, BLOCK_N, MASK_N, T, lo, hi)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, k_src, v_src, skt, svt, rows, cols, first, full_lo, T, lo, hi,
                   qk_scale, HEAD_DIM, BLOCK_D, MASK_N, DOT_PRECISION, True, HOPPER)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, k_src, v_src, skt, svt, rows, cols, full_lo, full_hi, T, lo, hi,
                   qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, False, HOPPER)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, k_src, v_src, skt, svt, rows, cols, full_hi, last, T, lo, hi,
                   qk_scale, HEAD_DIM, BLOCK_D, MASK_N, DOT_PRECISION, True, HOPPER)
    _store_tile(DQ + b * sdqb + h * sdqh, rows, sdqt, cols, (dq * sm_scale).to(DQ.dtype.element_ty), T, HEAD_DIM)


def banded_attention(q, k, v, lo: int, hi: int, deterministic: bool = False):
    """softmax(QKᵀ/√D + band mask) V for q, k, v of shape (B, H, T, D); differentiable once.

    deterministic=True: the backward computes dQ in a pass of its own instead of adding it
    atomically (see the module docstring), so the gradients are the same bits on every run.

    When q, k, v are the [..., 0, :], [..., 1, :], [..., 2, :] slices of one (B, T, H, 3, D) buffer
    (a fused QKV projection, as model.layers.SelfAttention makes them), the kernel takes that
    buffer itself and its backward writes dQ, dK and dV straight into one (B, T, H, 3, D)
    gradient, the fused projection's: no stacking of three gradients, no copy to make it
    contiguous. Gradient hooks registered on the slices themselves then do not fire. The output is
    (B, H, T, D) laid out as (B, T, H, D), so merging the heads back into (B, T, H·D) is a view.
    """
    check_inputs(q, k, v)
    qkv = packed_qkv(q, k, v)
    if qkv is not None:
        return _FlashAttention.apply(lo, hi, deterministic, qkv)
    return _FlashAttention.apply(lo, hi, deterministic, *(_unit_stride(x) for x in (q, k, v)))


def check_inputs(q, k, v) -> None:
    """Refuse what the kernel cannot take: mismatched q, k, v, a rank, device, dtype or head dim it lacks."""
    if not (q.shape == k.shape == v.shape) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share shape (B, H, T, D) and dtype; got {q.shape}, {k.shape}, "
                         f"{v.shape} and {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 4:
        raise ValueError(f"impl='triton' takes 4-d q, k, v (B, H, T, D), not shape {tuple(q.shape)}")
    if not q.is_cuda and not INTERPRET:
        raise ValueError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported")
    if INTERPRET and q.dtype == torch.bfloat16:
        raise ValueError("impl='triton' under TRITON_INTERPRET=1 takes float32 or float16, not torch.bfloat16: "
                         "the interpreter's tl.dot has no bfloat16 and would return wrong products")
    dtypes = INTERPRET_DTYPES if INTERPRET else DTYPES
    if q.dtype not in dtypes:
        raise ValueError(f"impl='triton' takes {[str(d) for d in dtypes]}, not {q.dtype}: use bf16 autocast, "
                         "or impl='sdpa' (or 'auto', which picks it for float32 on CUDA)")
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"impl='triton' takes head dims 1 to {MAX_HEAD_DIM}, not {q.shape[-1]}")


def packed_qkv(q, k, v):
    """The (B, T, H, 3, D) view of the one buffer q, k, v slice, when they are exactly its three
    slices (each (B, H, T, D)); otherwise None."""
    base = q._base  # the tensor a view was taken of; shared by views of views
    if base is None or k._base is not base or v._base is not base or not base.is_contiguous():
        return None
    b, h, t, d = q.shape
    if base.numel() != b * t * h * 3 * d:
        return None
    strides = (t * h * 3 * d, 3 * d, h * 3 * d, 1)  # of (B, H, T, D) in a (B, T, H, 3, D) layout
    for i, x in enumerate((q, k, v)):
        if x.shape != q.shape or x.stride() != strides or x.storage_offset() != base.storage_offset() + i * d:
            return None
    return base.view(b, t, h, 3, d)


def _split(tensors):
    """(q, k, v), each (B, H, T, D), from (qkv,) packed as (B, T, H, 3, D) or from (q, k, v)."""
    return tensors[0].permute(3, 0, 2, 1, 4).unbind(0) if len(tensors) == 1 else tensors


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lo, hi, deterministic, *tensors):
        """tensors: (qkv,) packed (B, T, H, 3, D), or (q, k, v) each (B, H, T, D) with unit last stride."""
        o, lse = flash_forward(tensors, lo, hi)
        ctx.save_for_backward(*tensors, o, lse)
        ctx.band = (lo, hi)
        ctx.deterministic = deterministic
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        *tensors, o, lse = ctx.saved_tensors
        return None, None, None, *flash_backward(tensors, o, lse, do, *ctx.band, ctx.deterministic)


def flash_forward(tensors, lo: int, hi: int):
    """(O, LSE) of the forward kernel: O (B, H, T, D) laid out as (B, T, H, D), LSE (B, H, T) float32,
    base 2. tensors: (qkv,) packed (B, T, H, 3, D), or (q, k, v) each (B, H, T, D) with unit last stride."""
    q, k, v = _split(tensors)
    b, h, t, d = q.shape
    o = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)  # (B, H, T, D)
    lse = torch.empty(b, h, t, dtype=torch.float32, device=q.device)  # (B, H, T), base 2
    grid = lambda meta: (b * h, triton.cdiv(t, meta["BLOCK_M"]))  # noqa: E731
    with _device_of(q):
        _fwd_kernel[grid](q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                          h, t, lo, hi, LOG2E / math.sqrt(d), *tuning_key(t, lo, hi), **_shape_args(q),
                          HOPPER=_hopper_path(q, k, v))
    return o, lse


def flash_backward(tensors, o, lse, do, lo: int, hi: int, deterministic: bool):
    """The backward kernels: (dQKV,) packed like tensors, or (dQ, dK, dV) each (B, H, T, D) laid out
    as (B, T, H, D), from the forward's tensors, O, LSE and dO."""
    q, k, v = _split(tensors)
    do = _unit_stride(do)
    b, h, t, d = q.shape
    shape_args = _shape_args(q)
    hopper = _hopper_path(q, k, v, do)
    if len(tensors) == 1:
        grads = (torch.empty_like(tensors[0]),)  # (B, T, H, 3, D): the fused projection's gradient
    else:
        grads = tuple(torch.empty(b, t, h, d, dtype=q.dtype, device=q.device).transpose(1, 2) for _ in range(3))
    dq, dk, dv = _split(grads)  # each (B, H, T, D); dk and dv share strides
    # the atomic form's float32 dQ accumulator; the deterministic one writes dq directly
    dq_acc = dq if deterministic else torch.empty(b, t, h, d, dtype=torch.float32,
                                                  device=q.device).transpose(1, 2)  # (B, H, T, D)
    delta = torch.empty_like(lse)  # (B, H, T)
    preprocess_block = INTERPRET_BWD[0] if INTERPRET else PREPROCESS_BLOCK
    key_grid = lambda meta: (b * h, triton.cdiv(t, meta["BLOCK_N"]))  # noqa: E731
    scales = (1.0 / math.sqrt(d), LOG2E / math.sqrt(d))  # sm_scale = 1/√D, qk_scale = log2(e)/√D
    with _device_of(q):
        _bwd_preprocess[(b * h, triton.cdiv(t, preprocess_block))](
            o, do, delta, dq_acc, *_strides(o), *_strides(do), *_strides(dq_acc), h, t,
            HEAD_DIM=d, BLOCK_D=shape_args["BLOCK_D"], BLOCK_M=preprocess_block, ZERO_DQ=not deterministic)
        kv_kernel = _bwd_kv_kernel if deterministic else _bwd_kernel
        kv_kernel[key_grid](q, k, v, do, lse, delta, dq_acc, dk, dv, *_strides(q), *_strides(k), *_strides(v),
                            *_strides(do), *_strides(dq_acc), *_strides(dk), h, t, lo, hi, *scales,
                            *tuning_key(t, lo, hi), **shape_args, HOPPER=hopper, ATOMIC_DQ=not deterministic)
        if deterministic:
            query_grid = lambda meta: (b * h, triton.cdiv(t, meta["BLOCK_M"]))  # noqa: E731
            _bwd_dq_kernel[query_grid](q, k, v, do, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v),
                                       *_strides(do), *_strides(dq), h, t, lo, hi, *scales,
                                       *tuning_key(t, lo, hi), **shape_args, HOPPER=hopper)
    if not deterministic:
        dq.copy_(dq_acc)  # float32 → q's dtype, into its slot of the packed gradient
    return grads


def _shape_args(q):
    """Compile-time arguments shared by the kernels: head dim, its power-of-two padding, dot precision."""
    d = q.shape[-1]
    return {
        "HEAD_DIM": d,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


def _hopper_path(*tensors) -> bool:
    """Whether the kernels run their Hopper path (HOPPER: inner tiles through TMA tensor descriptors,
    the dQ product transposed for wgmma): on sm_90 and newer GPUs, and under the interpreter while
    INTERPRET_HOPPER holds; and only when every tensor (B, H, T, D) with unit last stride has its base
    and its batch, head and time strides 16-byte aligned, as a descriptor needs (so half-precision
    head dims that are multiples of 8). On a GPU it also installs the allocator Triton asks, at each
    launch, for the descriptors' global scratch (`_descriptor_scratch`)."""
    x = tensors[0]
    if INTERPRET:
        available = INTERPRET_HOPPER
    else:
        available = x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
    aligned = all(t.data_ptr() % 16 == 0 and all(t.stride(i) * t.element_size() % 16 == 0 for i in range(3))
                  for t in tensors)
    if available and aligned and x.is_cuda:
        # Triton keeps its allocator in a context variable: the autograd engine's backward thread
        # does not see one set in the forward's thread, so it is set at every launch.
        triton.set_allocator(_descriptor_scratch)
    return available and aligned


def _descriptor_scratch(size: int, alignment: int, stream):
    """Global scratch for the descriptors the kernels build on the device, on the current GPU (the
    launches run under `_device_of`); the caching allocator makes it cheap."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _strides(x):
    """(batch, head, time) strides of a (B, H, T, D) tensor whose last stride is 1."""
    return x.stride(0), x.stride(1), x.stride(2)


def _device_of(x):
    """Launch on x's GPU even when another one is current; nothing to select for CPU tensors."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _unit_stride(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def autotuners() -> dict:
    """The autotuned kernels by name, whose choices a run records and a resumed process pins
    (model/kernel_choices.py)."""
    return {"forward": _fwd_kernel, "backward": _bwd_kernel, "backward_kv": _bwd_kv_kernel, "backward_dq": _bwd_dq_kernel}
