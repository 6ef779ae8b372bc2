"""A linear layer whose backward can recompute its input and overlap a reduction of its input gradient.

    y = x Wᵀ + b                         forward (x (…, k), W (n, k), b (n,))
    ∂L/∂x = g W,  ∂L/∂W = gᵀ x,  ∂L/∂b = Σ_rows g     backward, g = ∂L/∂y flattened to (N, n)

`linear(x, weight, bias, recompute=…, reduce_input_grad=…)` computes exactly F.linear's forward and
autograd's gradients (the same matrix products in the same layout, equal bit for bit on the CPU),
with two choices plain autograd does not offer:

- recompute=Recompute(fn, *sources): x is not kept for backward; backward recomputes x = fn(*sources)
  under no_grad. Selective activation recomputation passes a LayerNorm and its input (kept anyway by
  the LayerNorm's own backward), or a GELU and the fc output (kept anyway by the GELU's backward), so
  the (…, k) input stops being held while nothing new is: fn is elementwise or per row, no matrix
  product and no communication is ever repeated, and a deterministic fn gives x's bits again.
- reduce_input_grad(grad_x, during) → (reduced grad_x, during()): backward hands it ∂L/∂x = g W and
  the weight and bias gradients' products to run meanwhile, so a collective (the tensor-parallel
  all-reduce or reduce-scatter of the input gradient, parallel/comm.py's overlapped_reduction) runs
  while gᵀ x computes; backward returns the reduced input gradient.

Under autocast the products run in the autocast dtype, as F.linear's would, and the casts of x and W
are what is kept (as autograd keeps them for F.linear).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Recompute:
    """x = fn(*sources), the linear's input, recomputed in backward instead of kept."""

    fn: Callable[..., torch.Tensor]
    sources: tuple[torch.Tensor, ...]

    def __init__(self, fn: Callable[..., torch.Tensor], *sources: torch.Tensor):
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "sources", sources)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recompute, reduce_input_grad):
        dtype = _autocast_dtype(x)
        x_cast, w_cast = x.to(dtype), weight.to(dtype)  # the very tensors when no cast applies
        y = F.linear(x_cast, w_cast, None if bias is None else bias.to(dtype))  # (…, n)
        kept = recompute.sources if recompute is not None else (x_cast,)
        ctx.save_for_backward(w_cast, *kept)
        ctx.recompute, ctx.reduce_input_grad = recompute, reduce_input_grad
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        w, *kept = ctx.saved_tensors
        if ctx.recompute is not None:
            with torch.no_grad():
                kept = [ctx.recompute.fn(*kept).to(ctx.x_dtype)]
        x = kept[0].reshape(-1, kept[0].shape[-1])  # (N, k)
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)  # (N, n)
        grad_x = g.mm(w).view(ctx.x_shape)  # (…, k)

        def parameter_grads():
            return g.t().mm(x), (g.sum(0) if ctx.has_bias else None)  # (n, k), (n,)

        if ctx.reduce_input_grad is None:
            grad_w, grad_b = parameter_grads()
        else:
            grad_x, (grad_w, grad_b) = ctx.reduce_input_grad(grad_x, parameter_grads)
        return grad_x, grad_w, grad_b, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recompute: Recompute | None = None,
    reduce_input_grad: Callable | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) (…, k) → (…, n), with the backward choices of the module docstring;
    without either it is F.linear itself."""
    if recompute is None and reduce_input_grad is None:
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias, recompute, reduce_input_grad)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Linear(torch.nn.Linear):
    """nn.Linear whose forward takes an optional Recompute of its input (see `linear`)."""

    def forward(self, x: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, recompute)  # (…, out_features)
