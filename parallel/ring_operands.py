"""What a ring-decomposed layer (parallel/overlap.py) sends and multiplies: its operands in the compute dtype, or
cast to float8 once, before the ring, so that the sequence pieces travel in float8 with the scale all ranks share.

A float8 layer (model/float8.py, tensorwise recipe) quantizes x̂ = sat(x · s_x), s_x = f_max / amax(x), the amax over
the whole operand. In the ring no rank holds the whole gathered operand, so each rank takes the amax of what it
holds and the ranks all-reduce their MAX (the forward's x and W in one call, the backward's g in another): s_x is
then the scale a rank holding all of x computes, the cast is elementwise, and each float8 piece is exactly that
piece of the undecomposed layer's x̂. So the gathered activations cross the ring in one byte an element instead of
bf16's two, and each GEMM chunk multiplies float8 rows by Ŵ (torch._scaled_mm). The tensorwise recipe casts x (and
g) to the same format with the same scale for both products it enters, so the gathered x̂ (ĝ) is also the weight
gradient's operand: nothing is cast twice, and the kept input is half bf16's size. Partial sums (the scattered
products) travel in the output dtype.

                    travels in the ring     chunked, whole on the rank     weight gradient
    column (out)    x̂ pieces (forward)      ĝ (input grad)                 ĝᵀ x̂_gathered
    row (in)        ĝ pieces (input grad)   x̂ (forward)                    ĝ_gatheredᵀ x̂

Each operations object: forward(x, W, b) → (x sent, the product of its rows, the weight state backward keeps);
backward(grad, weight state) → (g sent, the product of its rows, g's scale and inverse scale or None);
weight_products(g whole (N, n), weight state, those scales) → an object whose weight_grad(x (N, k)) is gᵀ x;
recast(x, weight state) → a recomputed input as forward sent it. A scale's inverse, which torch._scaled_mm multiplies
by, is made with it (model/float8.py's float8_scales: one kernel on a GPU) and used by every product of its operand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.float8 import Float8Matmuls, _amax, _padded, _tensorwise, cast_to_float8, float8_scales, inverse_scaled_mm
from model.recompute import MATMULS, Grads, autocast_dtype


class PlainOperands:
    """The products in the compute dtype (autocast's, or the tensors' own), as F.linear and its autograd."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        dtype = autocast_dtype(x)
        x_cast, w_cast = x.to(dtype), weight.to(dtype)
        b_cast = None if bias is None else bias.to(dtype)
        return x_cast, lambda rows: F.linear(rows, w_cast, b_cast), (w_cast,)

    def backward(self, grad: torch.Tensor, state: tuple) -> tuple:
        (w_cast,) = state
        return grad.to(w_cast.dtype), lambda rows: rows.matmul(w_cast), None

    def weight_products(self, g: torch.Tensor, state: tuple, grad_scales: None) -> Grads:
        return Grads(g)  # (N, n)

    def recast(self, x: torch.Tensor, state: tuple) -> torch.Tensor:
        return x.to(state[0].dtype)


class Float8Operands:
    """The products of a float8 layer (tensorwise) with each operand cast once (module docstring). `matmuls`: the
    layer's Float8Matmuls (its recipe's formats, its product, its amax reduction over the ranks, and where the
    weight's casts are kept through a step: model/float8_weights.py)."""

    def __init__(self, matmuls: Float8Matmuls):
        m = matmuls
        x_casts = (m.forward_configs[0], m.weight_grad_configs[1])
        g_casts = (m.input_grad_configs[0], m.weight_grad_configs[0])
        w_casts = (m.forward_configs[1], m.input_grad_configs[1])
        for casts in (x_casts, g_casts, w_casts):
            if not all(_tensorwise(c) for c in casts) or casts[0].target_dtype != casts[1].target_dtype:
                raise ValueError("parallel.tp_comm_overlap with float8 casts each operand once for both of its "
                                 "products, which needs train.fp8_recipe=tensorwise (one scale, one format per "
                                 "tensor); rowwise scales each product's operand along its own rows")
        if x_casts[0].target_dtype != w_casts[0].target_dtype:
            raise ValueError("float8 x and W in different formats: their scales are made together")
        self.m = m
        self.x_dtype, self.g_dtype = x_casts[0].target_dtype, g_casts[0].target_dtype

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """x (…, k) this rank's part of the input (a sequence piece, or its k/p features), W (n, k): x̂ (…, k) and
        the product of its rows, x̂_rows Ŵᵀ + b. W's amax, scale and casts are kept through the step."""
        kept = self._kept(weight)
        if kept is None:  # x's and W's amaxes in one reduction, their scales and inverses in one computation
            amaxes = self.m.reduce_max(torch.stack([_amax(x, None), _amax(weight, None)]), "forward")  # (2,)
            scales, inverses = float8_scales(amaxes, self.x_dtype, self.m.power_of_2)  # (2,), (2,)
            scale_x, inverse_x = scales[0], inverses[0]
            forward = cast_to_float8(weight, scales[1], self.x_dtype, transposed=False).t()  # (k, n) col-major
            kept = {"scale": scales[1], "inverse": inverses[1], "forward": forward}
            if self.m.weight_casts is not None:
                self.m.weight_casts.keep(weight, kept)
        else:
            scale_x, inverse_x = self._scales(x, self.x_dtype, "forward")
        x8 = cast_to_float8(x.reshape(-1, x.shape[-1]), scale_x, self.x_dtype, transposed=False).view(x.shape)
        fast = self.m.forward_configs[2].use_fast_accum

        def product(rows: torch.Tensor) -> torch.Tensor:  # rows (…, k) float8 → (…, n)
            y = self._multiply(rows.reshape(-1, rows.shape[-1]), scale_x, inverse_x, kept["forward"], kept["scale"],
                               kept["inverse"], x.dtype, fast, bias)
            return y.view(*rows.shape[:-1], weight.shape[0])

        return x8, product, (weight, scale_x, inverse_x)

    def backward(self, grad: torch.Tensor, state: tuple) -> tuple:
        """grad (…, n) this rank's part of ∂L/∂y: ĝ (…, n), the product of its rows, ĝ_rows Ŵ (…, k), and g's
        scale and its inverse."""
        weight = state[0]
        scale_g, inverse_g = self._scales(grad, self.g_dtype, "backward")  # (), ()
        g8 = cast_to_float8(grad.reshape(-1, grad.shape[-1]), scale_g, self.g_dtype, transposed=False).view(grad.shape)
        kept = self._weight_for_input_grad(weight)
        fast = self.m.input_grad_configs[2].use_fast_accum

        def product(rows: torch.Tensor) -> torch.Tensor:  # rows (…, n) float8 → (…, k)
            out = self._multiply(rows.reshape(-1, rows.shape[-1]), scale_g, inverse_g, kept["backward"],
                                 kept["scale"], kept["inverse"], weight.dtype, fast)
            return out.view(*rows.shape[:-1], weight.shape[1])

        return g8, product, (scale_g, inverse_g)

    def _weight_for_input_grad(self, weight: torch.Tensor) -> dict:
        """W's operands with its input-gradient layout, Ŵ (n, k) column-major: kept from this step's forward, or
        (outside a step, or a forward in no step) made again from W's amax, reduced over the ranks."""
        kept = self._kept(weight)
        if kept is None:
            scale_w, inverse_w = self._scales(weight, self.x_dtype, "backward")
            kept = {"scale": scale_w, "inverse": inverse_w}
        if "backward" not in kept:
            kept["backward"] = cast_to_float8(weight, kept["scale"], self.x_dtype, transposed=True).t()
        return kept

    def _scales(self, t: torch.Tensor, dtype: torch.dtype, phase: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, 1/s) of the whole operand `t` is a piece of: its amax reduced over the ranks (in `phase`), () each."""
        amax = self.m.reduce_max(_amax(t, None).reshape(1), phase)  # (1,)
        scale, inverse = float8_scales(amax, dtype, self.m.power_of_2)
        return scale[0], inverse[0]

    def _kept(self, weight: torch.Tensor) -> dict | None:
        """W's operands kept in this step (model/float8_weights.py), or None."""
        return self.m.weight_casts.kept(weight) if self.m.weight_casts is not None else None

    def weight_products(self, g8: torch.Tensor, state: tuple, scales_g: tuple) -> "_Float8WeightGrad":
        """g8 (N, n) the whole ĝ, scales_g its scale and inverse (backward's third value)."""
        weight, *scales_x = state
        return _Float8WeightGrad(self, g8, scales_g, tuple(scales_x), weight.dtype)

    def recast(self, x: torch.Tensor, state: tuple) -> torch.Tensor:
        """A recomputed input x (…, k) quantized as forward quantized it (its scale kept)."""
        return cast_to_float8(x.reshape(-1, x.shape[-1]), state[1], self.x_dtype, transposed=False).view(x.shape)

    def _multiply(self, a8, scale_a, inverse_a, b8, scale_b, inverse_b, dtype: torch.dtype, fast: bool,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
        """(Â/s_A)(B̂/s_B) (+ bias) for Â (M, K) row-major and B̂ (K, P) column-major, zero-padded to multiples of
        ALIGN where they are not (no product changes): (M, P) in `dtype`. On the GPU by the inverse scales made
        once per operand (one kernel a product), emulated as the layer's own products are."""
        rows, cols = a8.shape[0], b8.shape[1]
        a8, b8 = _padded(a8), _padded(b8.t()).t()
        if self.m.emulate:
            out = self.m.multiply(a8, scale_a, b8, scale_b, dtype, fast)
            out = out if out.shape == (rows, cols) else out[:rows, :cols]
            return out.contiguous() if bias is None else out + bias
        out = inverse_scaled_mm(a8, inverse_a, b8, inverse_b, dtype, fast, _padded_bias(bias, b8.shape[1]))
        return out if out.shape == (rows, cols) else out[:rows, :cols].contiguous()


class _Float8WeightGrad:
    """∂L/∂W = ĝᵀ x̂ from the float8 operands the ring already holds: ĝ (N, n) and x̂ (N, k)."""

    def __init__(self, ops: Float8Operands, g8: torch.Tensor, scales_g: tuple, scales_x: tuple, dtype: torch.dtype):
        """scales_g, scales_x: (scale, inverse) of ĝ and of x̂."""
        self.ops, self.g8, self.scales_g, self.scales_x, self.dtype = ops, g8, scales_g, scales_x, dtype

    def weight_grad(self, x8: torch.Tensor) -> torch.Tensor:
        a8 = self.g8.t().contiguous()  # (n, N) row-major
        b8 = x8.t().contiguous().t()  # (N, k) column-major
        fast = self.ops.m.weight_grad_configs[2].use_fast_accum
        return self.ops._multiply(a8, *self.scales_g, b8, *self.scales_x, self.dtype, fast)  # (n, k)


def _padded_bias(bias: torch.Tensor | None, columns: int) -> torch.Tensor | None:
    """The bias (P,) with zeros up to `columns` (the padded product's), or None."""
    if bias is None or bias.shape[0] == columns:
        return bias
    return torch.nn.functional.pad(bias, (0, columns - bias.shape[0]))


PLAIN = PlainOperands()  # holds nothing: one for every layer


def ring_operands(matmuls) -> PlainOperands | Float8Operands:
    """The operations of a ring layer whose products are `matmuls` (model/recompute.py's MATMULS or a Float8Matmuls)."""
    return PLAIN if matmuls is MATMULS else Float8Operands(matmuls)
