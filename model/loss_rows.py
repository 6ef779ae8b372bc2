"""The fused loss's two passes over a chunk of logits, each one kernel: the rows' softmax statistics, and
their cross-entropy gradient written over the logits.

For a chunk of logits z (C, W) whose first `real` columns are vocabulary (the rest padding, never in the
softmax), targets y (C,) local to the chunk's columns and `owned` (C,) saying which targets lie in them:

  row_stats    m_c = max_{j<real} z_cj,   s_c = Σ_{j<real} exp(z_cj − m_c),   t_c = z_{c,y_c} if owned_c else 0
               (fp32; a vocabulary-parallel caller combines them over ranks: M = max m, S = Σ s·exp(m − M),
               T = Σ t, model/fused_loss.py)
  row_grad_    z_cj ← (exp(z_cj − M_c) / S_c − [j = y_c and owned_c]) · scale_c  for j < real, 0 for the
               padding: ∂ℓ_c/∂z_c scaled (by 1/|kept| for kept rows, 0 for ignored ones), in z's dtype

Each reads z once (the gradient also writes it once): 2 bytes an element read and 2 written per pass in bf16,
where the same math in torch operators makes about a dozen fp32 passes. On CUDA each is one Triton kernel
(model/loss_rows_triton.py; its tests run it on the CPU through TRITON_INTERPRET=1), one program per row,
looping over the columns in blocks with an online maximum (m, s updated together, s rescaled by
exp(m_old − m_new)); elsewhere torch operators compute the same in fp32, a block of rows at a time. Both are torch.library custom
ops, so the compiler and the step bill (bench/op_ledger.py) see one call each.
"""

from __future__ import annotations

import torch

CPU_BLOCK_ELEMENTS = 2**20  # logits a block of the CPU path takes at once (4 MiB in fp32)


@torch.library.custom_op("gpt3d::loss_row_stats", mutates_args=())
def row_stats(z: torch.Tensor, targets: torch.Tensor, owned: torch.Tensor,
              real: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, s, t), each (C,) fp32, of z (C, W): see the module docstring."""
    if z.is_cuda:
        return _kernels().row_stats(z, targets, owned, real)
    m = torch.full(z.shape[:1], float("-inf"), dtype=torch.float32, device=z.device)  # (C,)
    s = torch.zeros_like(m)  # (C,)
    for i, j in _row_blocks(z.shape[0], real):
        zf = z[i:j, :real].float()  # (b, real)
        m[i:j] = zf.amax(dim=-1)
        s[i:j] = (zf - m[i:j, None]).exp_().sum(dim=-1)
    t = torch.where(owned, z[:, :real].gather(-1, targets.clamp(0, max(real - 1, 0)).unsqueeze(-1)).squeeze(-1).float()
                    if real else torch.zeros_like(m), 0.0)  # (C,)
    return m, s, t


@row_stats.register_fake
def _(z, targets, owned, real):
    return tuple(z.new_empty(z.shape[0], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("gpt3d::loss_row_grad_", mutates_args=("z",))
def row_grad_(z: torch.Tensor, targets: torch.Tensor, owned: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
              scale: torch.Tensor, real: int) -> None:
    """z (C, W) ← the scaled cross-entropy gradient of its rows, given the (combined) m and s: see the module
    docstring."""
    if z.is_cuda:
        _kernels().row_grad_(z, targets, owned, m, s, scale, real)
        return
    for i, j in _row_blocks(z.shape[0], real):
        g = (z[i:j, :real].float() - m[i:j, None]).exp_().div_(s[i:j, None])  # (b, real) softmax
        g.scatter_add_(1, targets[i:j].clamp(0, max(real - 1, 0)).unsqueeze(-1), -owned[i:j].to(g.dtype).unsqueeze(-1))
        z[i:j, :real] = g.mul_(scale[i:j, None])
    z[:, real:] = 0


def _row_blocks(rows: int, real: int) -> list[tuple[int, int]]:
    """[(first row, end)] of blocks of about CPU_BLOCK_ELEMENTS logits: the CPU path's fp32 temporaries are
    one block's, small enough to stay in cache and to be reused by the allocator from block to block (a whole
    chunk's, hundreds of MB, would be mapped afresh and faulted in page by page at every call)."""
    step = max(1, CPU_BLOCK_ELEMENTS // max(real, 1))
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


def _kernels():
    from model import loss_rows_triton

    return loss_rows_triton  # triton is imported only when a kernel runs
