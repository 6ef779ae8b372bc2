"""The float8 scales of model/float8.py's float8_scales in one Triton kernel: for each amax a, the tensorwise scale
s = f_max / max(a, ε) and its inverse 1/s, as torchao's amax_to_scale and torch's reciprocal give them, bit for bit.

torchao computes s in float64 as Python's `f_max / tensor` runs: the reciprocal of the clamped amax, then times
f_max (two roundings), then rounds s to float32; the product's inverse scale is 1/s in float32. Eager, that is
six kernels on a handful of numbers (a cast, the clamp, the reciprocal, the product, the cast back, the
reciprocal); each is a launch the host pays for while the GPU waits on nothing. This kernel does all six in one
program with IEEE-rounded divisions (float64's is always rounded; float32's by div_rn, as CUDA's `1 / x` is), so
the values are the same. A NaN amax stays NaN (the clamp keeps it), an infinite one gives s = 0 and 1/s = inf, as
in torch.
Run on the CPU through TRITON_INTERPRET=1 by its tests, where it must equal the torch ops bit for bit."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
EPS = tl.constexpr(1e-12)  # torchao's floor under an amax (float8_utils.EPS)


@triton.jit
def _scales_kernel(AMAX, SCALE, INVERSE, n, stride, F_MAX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    inside = i < n
    amax = tl.load(AMAX + i, mask=inside, other=1.0).to(tl.float64)  # (BLOCK,)
    amax = tl.where(amax < EPS, EPS, amax)  # torch.clamp(amax, min=EPS): NaN compares false and stays
    scale = ((1.0 / amax) * F_MAX).to(tl.float32)  # f_max / amax as torch runs it: 1/amax (div.rn.f64), then · f_max
    inverse = tl.math.div_rn(tl.full((BLOCK,), 1.0, tl.float32), scale)
    tl.store(SCALE + i * stride, scale, mask=inside)
    tl.store(INVERSE + i * stride, inverse, mask=inside)


def scales_into(amax: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, inverse: torch.Tensor) -> None:
    """Writes s and 1/s (float32) for the fp32 amaxes `amax` (a few numbers), float8 `dtype`, into `scale` and
    `inverse`: shaped like `amax`, their elements evenly strided (model/float8.py keeps each 16 bytes apart)."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"float8 scales for {dtype}: must be torch.float8_e4m3fn or torch.float8_e5m2")
    flat, stride = amax.reshape(-1).contiguous(), scale.reshape(-1).stride(0)
    if inverse.reshape(-1).stride(0) != stride:
        raise ValueError("float8 scales: the scales and their inverses must be strided alike")
    _scales_kernel[(1,)](flat, scale, inverse, flat.numel(), stride, F_MAX=torch.finfo(dtype).max,
                         BLOCK=triton.next_power_of_2(max(flat.numel(), 2)))
