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
- weight_grads=WeightGradStore: backward computes ∂L/∂x only (and reduces it, as above) and hands the
  store the weight and bias gradients' products, which a zero-bubble pipeline schedule runs later
  (model/weight_grads.py); every product still runs once.
- gather_input(x) → the full input: the forward's all-gather of sequence-parallel pieces, done inside
  the layer so that its adjoint, the reduce-scatter of ∂L/∂x, is the reduction backward overlaps
  (then reduce_input_grad returns this rank's piece, and x is kept gathered: no recompute).

Under autocast the products run in the autocast dtype, as F.linear's would, and the casts of x and W
are what is kept (as autograd keeps them for F.linear).

The three products themselves are the layer's `matmuls`, chosen when the layer is built: MATMULS (the
plain ones above) or model/float8.py's Float8Matmuls (train.precision=fp8), each as
forward(x, W, b) → (y, kept) and backward(g, kept) → an object whose input_grad(W) = g W and
weight_grad(x) = gᵀ x are separate calls, so the weight-gradient product can run while the
input gradient's reduction does, or later.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model.modes import Fixed, Float8
from model.weight_grads import WeightGradStore


class Recompute:
    """x = fn(*sources), the linear's input, recomputed in backward instead of kept."""

    def __init__(self, fn: Callable[..., torch.Tensor], *sources: torch.Tensor):
        self.fn, self.sources = fn, sources


class Matmuls:
    """The layer's three products in the compute dtype, as F.linear and its autograd compute them."""

    def forward(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        return F.linear(x, w, bias), ()  # (…, n), nothing kept beyond x and W

    def backward(self, g: torch.Tensor, kept: tuple) -> "Grads":
        return Grads(g)


class Grads:
    """The backward products of g (N, n): input_grad(W) = g W (N, k), weight_grad(x) = gᵀ x (n, k)."""

    def __init__(self, g: torch.Tensor):
        self.g = g

    def input_grad(self, w: torch.Tensor) -> torch.Tensor:
        return self.g.mm(w)  # (N, k)

    def weight_grad(self, x: torch.Tensor) -> torch.Tensor:
        return self.g.t().mm(x)  # (n, k)


MATMULS = Matmuls()


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recompute, reduce_input_grad, gather_input, matmuls, weight_grads):
        if gather_input is not None:
            x = gather_input(x)  # (…, k), from this rank's piece of the sequence
        dtype = autocast_dtype(x)
        x_cast, w_cast = x.to(dtype), weight.to(dtype)  # the very tensors when no cast applies
        y, kept_by_matmuls = matmuls.forward(x_cast, w_cast, None if bias is None else bias.to(dtype))  # (…, n)
        kept = recompute.sources if recompute is not None else (x_cast,)
        ctx.save_for_backward(w_cast, *kept_by_matmuls, *kept)
        ctx.recompute, ctx.reduce_input_grad, ctx.matmuls = recompute, reduce_input_grad, matmuls
        ctx.weight_grads = weight_grads
        if weight_grads is not None:  # the leaves W's gradients go to (kept by reference: they live anyway)
            ctx.parameters = (weight, bias)
        ctx.kept_by_matmuls = len(kept_by_matmuls)
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        w, *kept = ctx.saved_tensors
        kept_by_matmuls, kept = kept[: ctx.kept_by_matmuls], kept[ctx.kept_by_matmuls :]
        if ctx.recompute is not None:
            with torch.no_grad():
                kept = [ctx.recompute.fn(*kept).to(ctx.x_dtype)]
        x = kept[0].reshape(-1, kept[0].shape[-1])  # (N, k)
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)  # (N, n)
        products = ctx.matmuls.backward(g, tuple(kept_by_matmuls))
        grad_x = products.input_grad(w).view(ctx.x_shape)  # (…, k)

        if ctx.weight_grads is not None:  # W later (model/weight_grads.py); the reduction of ∂L/∂x stays here
            if ctx.reduce_input_grad is not None:
                grad_x, _ = ctx.reduce_input_grad(grad_x, lambda: None)
            ctx.weight_grads.defer(*ctx.parameters, parameter_grads, products, x, g, ctx.has_bias)
            return grad_x, None, None, None, None, None, None, None
        if ctx.reduce_input_grad is None:
            grad_w, grad_b = parameter_grads(products, x, g, ctx.has_bias)
        else:
            grad_x, (grad_w, grad_b) = ctx.reduce_input_grad(grad_x, lambda: parameter_grads(products, x, g, ctx.has_bias))
        return grad_x, grad_w, grad_b, None, None, None, None, None


def parameter_grads(products, x: torch.Tensor, g: torch.Tensor, has_bias: bool) -> tuple:
    """The weight and bias gradients of a linear from its backward's products: gᵀ x (n, k) and Σ_rows g (n,)
    or None; x (N, k), g (N, n)."""
    return products.weight_grad(x), (g.sum(0) if has_bias else None)  # (n, k), (n,)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recompute: Recompute | None = None,
    reduce_input_grad: Callable | None = None,
    gather_input: Callable | None = None,
    matmuls=MATMULS,
    weight_grads: WeightGradStore | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) (…, k) → (…, n) through `matmuls`, with the backward choices of the
    module docstring; with none of them and the plain products it is F.linear itself. With a
    `weight_grads` store, backward returns ∂L/∂x only and hands the store the weight and bias
    gradients' products, run later by the pipeline schedule (model/weight_grads.py)."""
    plain = recompute is None and reduce_input_grad is None and gather_input is None and weight_grads is None
    if plain and matmuls is MATMULS:
        return F.linear(x, weight, bias)
    if recompute is not None and gather_input is not None:
        raise ValueError("a gathered input is kept, not recomputed: recomputing it would repeat the all-gather")
    if weight_grads is not None:
        return _deferring_linear(x, weight, bias, recompute, reduce_input_grad, gather_input, matmuls, weight_grads)
    return _Linear.apply(x, weight, bias, recompute, reduce_input_grad, gather_input, matmuls, weight_grads)


def _deferring_linear(*args) -> torch.Tensor:
    """_Linear with its weight gradients deferred, always eager: in a compiled block (model.compile) the graph
    breaks here, the compiled pieces before and after it keep their own backward, and this layer's backward
    hands its store the products to run later, which no compiled graph may trace (model/weight_grads.py
    compiles that later pass on its own)."""
    return eager_apply(_Linear)(*args)


@functools.cache
def eager_apply(function: type[torch.autograd.Function]) -> Callable:
    """function.apply that torch.compile does not trace (torch.compiler.disable), made on first use: disabling
    imports torch._dynamo, and with it Triton, which importing a module must not."""
    return torch.compiler.disable(function.apply)


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Linear(torch.nn.Linear):
    """nn.Linear whose forward takes an optional Recompute of its input (see `linear`), computing its
    products in float8 (model/float8.py) when built with a Float8 mode `fp8` (None: the plain ones),
    and deferring its weight gradients to `weight_grads` when built with a store (None: not deferred)."""

    fp8 = Fixed()
    matmuls = Fixed()
    weight_grads = Fixed()

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 fp8: Float8 | None = None, weight_grads: WeightGradStore | None = None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.fp8, self.matmuls, self.weight_grads = fp8, matmuls_for(fp8), weight_grads

    def forward(self, x: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        weight_grads = self.weight_grads if torch.is_grad_enabled() else None
        return linear(x, self.weight, self.bias, recompute, matmuls=self.matmuls,
                      weight_grads=weight_grads)  # (…, out_features)


def matmuls_for(fp8: Float8 | None, split: str | None = None, reduce_max: Callable | None = None):
    """The products of a layer built in the float8 mode `fp8` (model/float8.py: the tensor-parallel ranks
    split its weight along `split`, reduce_max reduces its amaxes over them); None: the plain MATMULS."""
    if fp8 is None:
        return MATMULS
    from model.float8 import Float8Matmuls

    return Float8Matmuls(fp8, split, reduce_max)
