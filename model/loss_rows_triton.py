"""The Triton kernels of model/loss_rows.py: one program per row of a (C, W) chunk of logits, its columns
read BLOCK_V at a time, exponentials as exp2 with log2(e) folded in, all arithmetic in fp32."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK_V = 64 if INTERPRET else 2048  # columns a program reads at a time
LOG2E = tl.constexpr(1.4426950408889634)  # a global a kernel reads must be a tl.constexpr object


@triton.jit
def _row_stats_kernel(Z, stride, TARGETS, OWNED, M, S, T, real, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, real, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(z_row + cols, mask=cols < real, other=float("-inf")).to(tl.float32)  # (BLOCK,)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((z - m_new) * LOG2E), axis=0)
        m = m_new
    owned = tl.load(OWNED + row) != 0
    target = tl.load(TARGETS + row)
    t = tl.load(z_row + target, mask=owned, other=0.0).to(tl.float32)
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(T + row, tl.where(owned, t, 0.0))


@triton.jit
def _row_grad_kernel(Z, stride, TARGETS, OWNED, M, S, SCALE, real, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride
    m = tl.load(M + row)
    scale = tl.load(SCALE + row) / tl.load(S + row)  # the softmax's 1/s and the row's scale together
    hit = tl.where(tl.load(OWNED + row) != 0, tl.load(TARGETS + row), -1)  # the target's column, or none
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(z_row + cols, mask=cols < real, other=float("-inf")).to(tl.float32)  # (BLOCK,)
        p = tl.exp2((z - m) * LOG2E) * scale  # padding: exp2(−inf) = 0
        g = tl.where(cols == hit, p - tl.load(SCALE + row), p)
        tl.store(z_row + cols, g.to(Z.dtype.element_ty), mask=cols < width)


def row_stats(z: torch.Tensor, targets: torch.Tensor, owned: torch.Tensor, real: int):
    """(m, s, t), each (C,) fp32 (model/loss_rows.py)."""
    c = z.shape[0]
    m, s, t = (torch.empty(c, dtype=torch.float32, device=z.device) for _ in range(3))
    _row_stats_kernel[(c,)](z, z.stride(0), targets, owned, m, s, t, real, BLOCK=BLOCK_V)
    return m, s, t


def row_grad_(z, targets, owned, m, s, scale, real: int) -> None:
    """z ← its rows' scaled cross-entropy gradient (model/loss_rows.py)."""
    _row_grad_kernel[(z.shape[0],)](z, z.stride(0), targets, owned, m, s, scale, real, z.shape[1], BLOCK=BLOCK_V)
