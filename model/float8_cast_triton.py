"""The float8 cast of model/float8.py in one Triton kernel: Â = sat(A · s) in float8, written straight into the
layout torch._scaled_mm takes (row-major for the first operand, column-major for the second).

One pass over A: each program reads a BLOCK_M × BLOCK_N tile of A (any strides, any dtype) and the matching
scales (one for the tensor, one per row or one per column: broadcast by stride 0), multiplies in fp32, clamps
to ±f_max, rounds to the float8 grid (nearest, ties to even: done in fp32 arithmetic, so that the conversion
itself is exact) and writes the tile at the output's strides.
The eager form it replaces reads A, writes it in fp32, reads that to scale it, again to clamp it, once more to
cast it, then copies the float8 result into the product's layout: seven passes over the tensor and a kernel
each; this one reads A once and writes one byte an element. Run on the CPU through TRITON_INTERPRET=1 by its
tests, where it must give model/float8.py's reference bit for bit."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK = 16 if INTERPRET else 64  # a program's tile is BLOCK × BLOCK
# float8 format → (f_max, mantissa bits, fp32's biased exponent of its smallest normal number)
_FORMATS = {torch.float8_e4m3fn: (448.0, 3, 127 - 6), torch.float8_e5m2: (57344.0, 2, 127 - 14)}
ROUNDING = tl.constexpr(12582912.0)  # 1.5 · 2^23: y + it − it rounds 0 ≤ y < 2^22 to an integer, ties to even, in fp32
SIGN = tl.constexpr(-(2**31))  # an fp32's sign bit, as an int32


@triton.jit
def _cast_kernel(A, stride_am, stride_an, S, stride_sm, stride_sn, OUT, stride_om, stride_on, M, N,
                 F_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r, c = rows[:, None].to(tl.int64), cols[None, :].to(tl.int64)
    inside = (r < M) & (c < N)
    a = tl.load(A + r * stride_am + c * stride_an, mask=inside, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_N)
    s = tl.load(S + r * stride_sm + c * stride_sn, mask=inside, other=1.0)  # fp32 scales, broadcast by stride 0
    q = tl.clamp(a * s, -F_MAX, F_MAX)
    # rounded to the float8 grid here, in fp32 (nearest, ties to even): |q| in steps of its binade's spacing,
    # 2^(e − MANTISSA), or of the subnormals' below the smallest normal binade, then q's sign put back (−0 stays
    # −0, as do negatives that round to zero); the cast then converts an exact float8 value
    bits = q.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, MIN_EXPONENT)
    spacing = ((exponent - MANTISSA) << 23).to(tl.float32, bitcast=True)
    per_spacing = ((254 - exponent + MANTISSA) << 23).to(tl.float32, bitcast=True)  # 1/spacing, exactly
    magnitude = ((tl.abs(q) * per_spacing + ROUNDING) - ROUNDING) * spacing
    q = (magnitude.to(tl.int32, bitcast=True) | (bits & SIGN)).to(tl.float32, bitcast=True)
    tl.store(OUT + r * stride_om + c * stride_on, q.to(OUT.dtype.element_ty), mask=inside)


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """sat(t · scale) in float8 `dtype`, t (M, N), scale () or (M, 1) or (1, N) in fp32: (M, N) contiguous, or
    with `transposed` its transpose (N, M) contiguous (the column-major (M, N) operand, as a view's base)."""
    if dtype not in _FORMATS:
        raise ValueError(f"float8 cast to {dtype}: must be one of {sorted(map(str, _FORMATS))}")
    m, n = t.shape
    written = torch.empty((n, m) if transposed else (m, n), dtype=dtype, device=t.device)
    out = written.t() if transposed else written  # (M, N) at the strides the kernel writes
    scales = scale.float().expand(m, n)  # strides 0 along the broadcast dimensions
    grid = (triton.cdiv(m, BLOCK), triton.cdiv(n, BLOCK))
    f_max, mantissa, min_exponent = _FORMATS[dtype]
    _cast_kernel[grid](t, t.stride(0), t.stride(1), scales, scales.stride(0), scales.stride(1), out, out.stride(0),
                       out.stride(1), m, n, F_MAX=f_max, MANTISSA=mantissa, MIN_EXPONENT=min_exponent,
                       BLOCK_M=BLOCK, BLOCK_N=BLOCK)
    return written
