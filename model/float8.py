"""The three matrix products of a linear layer in float8, with dynamic scaling (train.precision=fp8).

For y = x Wᵀ (x (N, k), W (n, k), g = ∂L/∂y (N, n)) each product C = A B (A (M, K), B (K, P)) runs as

    C = (Â / s_A) (B̂ / s_B),   Â = sat(A · s_A) in float8,   s = f_max / amax

on the GPU's float8 tensor cores (torch._scaled_mm, fp32 accumulation, output in A's dtype). The CPU
has the same op, about a thousand times slower than an fp32 product there, so a layer built with
Float8.emulate multiplies the same float8 operands as torchao emulates _scaled_mm: their exact values
over their scales, in one fp32 product (the sums rounded in another order). Operands are zero-padded to multiples of 16 in both dimensions where they are not (the
GPU's kernels need it; a decoding step has one token), which changes no amax and no product. f_max is the float8 format's largest value (448 for e4m3, 57344 for e5m2) and sat clamps
to ±f_max. The three products:

    forward       y  = x Wᵀ     A = x (N, k),   B = Wᵀ (k, n)
    input grad    ∂x = g W      A = g (N, n),   B = W (n, k)
    weight grad   ∂W = gᵀ x     A = gᵀ (n, N),  B = x (N, k)

The recipe (train.fp8_recipe) says, per operand of each product, the float8 format and what one scale
covers; both are torchao's recipes of the same names (Float8LinearConfig.from_recipe_name):
  tensorwise  one scale per tensor (amax over all of it); x and W in e4m3 (4 exponent bits, 3 mantissa
              bits: the precision activations and weights need, range ±448), g in e5m2 (5 exponent, 2
              mantissa bits: gradients span more orders of magnitude than one scale can cover in e4m3).
              A tensor's amax is computed once and serves both products it enters
  rowwise     one scale per row of the contraction: A's rows (M, 1), B's columns (1, P), amax over K;
              every operand in e4m3 (a row's own scale covers its range, so precision wins), scales
              rounded down to powers of two (scaling is then exact)

Layout invariance. Under tensor parallelism a rank holds pieces of some operands; quantizing a piece
with its own amax would give other float8 values than one process does. So each amax is all-reduced
(MAX) over the tensor-parallel group exactly when the elements it covers are spread over ranks, and
the quantized operands are then the one-process run's, element for element. `split` says which
dimension of W the layer's ranks split: "out" (column-parallel: W's rows, so g's columns too; x
replicated), "in" (row-parallel: W's columns and x's columns; g replicated), None (one rank). The
amaxes of one product's two operands that need it share one all-reduce. Sequence parallelism changes
no operand here: a column-parallel layer multiplies its gathered input, and a row-parallel layer's
output gradient is gathered before its backward.

    operand split along the      reduced: tensorwise        reduced: rowwise (when K is split)
    column   W rows, g columns   W (fwd), g (bwd)           g and W in the input grad (K = n)
    row      W and x columns     x and W (fwd)              x and W in the forward (K = k)

Which pieces are torchao's and which are ours: the recipes, amax → scale (amax_to_scale, with its
power-of-two rounding), the saturated cast (to_fp8_saturated) and the scaled product
(addmm_float8_unwrapped: torch._scaled_mm with inverse scales, and its rowwise arrangement) are torchao's
functions. Ours: the amax as one reduction (the infinity norm, the value torchao's tensor_to_amax gives), the
operand layouts _scaled_mm needs (A row-major, B column-major: torchao arranges them inside its tensor
subclass's matmul, which has no functional form), on a GPU the cast and the layout in one Triton kernel
(model/float8_cast_triton.py: torchao's cast bit for bit, one read of the operand and one float8 write instead
of seven passes; compiled blocks keep torchao's ops, which inductor fuses), and the amax reductions, which
torchao makes over a DeviceMesh for DTensor tensor parallelism, where gpt3d's plain-tensor layers reduce over
their own group, one recorded collective per product.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.float8_library import (
    Float8LinearConfig,
    ScalingGranularity,
    addmm_float8_unwrapped,
    amax_to_scale,
    to_fp8_saturated,
)
from model.modes import Float8

RECIPES = ("tensorwise", "rowwise")
SPLITS = (None, "in", "out")
ALIGN = 16  # _scaled_mm on the GPU takes operands whose both dimensions are multiples of 16


class Float8Matmuls:
    """The products of a linear layer in float8 (module docstring), for model/recompute.py's _Linear:
    forward(x, w, bias) → (y, kept), backward(g, kept) → Float8Grads.

    mode: the recipe (a name of RECIPES) and whether products are emulated (model.modes.Float8); split:
    the dimension of W split over the tensor-parallel ranks (SPLITS); reduce_max(amaxes, phase) → their
    elementwise MAX over those ranks (in place), needed with a split.
    """

    def __init__(self, mode: Float8, split: str | None = None, reduce_max: Callable | None = None):
        if mode.recipe not in RECIPES:
            raise ValueError(f"float8 recipe {mode.recipe!r}: must be one of {list(RECIPES)}")
        if split not in SPLITS or (split is None) != (reduce_max is None):
            raise ValueError(f"split={split!r} with reduce_max={reduce_max!r}: a split needs its reduction and only it")
        self.reduce_max = reduce_max
        self.emulate, self.weight_casts = mode.emulate, mode.weight_casts
        self.multiply = emulated_mm if mode.emulate else scaled_mm
        config = Float8LinearConfig.from_recipe_name(mode.recipe)
        # (A's cast, B's cast, the product's settings) of each of the three products
        self.forward_configs = (config.cast_config_input, config.cast_config_weight, config.gemm_config_output)
        self.input_grad_configs = (config.cast_config_grad_output, config.cast_config_weight_for_grad_input,
                                   config.gemm_config_grad_input)
        self.weight_grad_configs = (config.cast_config_grad_output_for_grad_weight,
                                    config.cast_config_input_for_grad_weight, config.gemm_config_grad_weight)
        self.power_of_2 = config.round_scales_to_power_of_2
        # the split dimension of x (N, k), W (n, k) and g (N, n), or None
        self.x_split = 1 if split == "in" else None
        self.w_split = {"in": 1, "out": 0, None: None}[split]
        self.g_split = 1 if split == "out" else None

    def forward(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """y = x Wᵀ + b (…, k) → (…, n), and what backward keeps: the tensorwise amaxes of x and W."""
        x2 = x.reshape(-1, x.shape[-1])  # (N, k)
        y, (amax_x, amax_w) = self.product(x2, self.x_split, w.t(), _flip(self.w_split), self.forward_configs,
                                           "forward")  # (N, n)
        y = y.view(*x.shape[:-1], w.shape[0])  # (…, n)
        if bias is not None:
            y = y + bias
        kept = tuple(a for a, cast in ((amax_x, self.forward_configs[0]), (amax_w, self.forward_configs[1]))
                     if _tensorwise(cast))
        return y, kept

    def backward(self, g: torch.Tensor, kept: tuple) -> "Float8Grads":
        """g (N, n) and the forward's kept amaxes → the two backward products (Float8Grads)."""
        return Float8Grads(self, g, kept)

    def product(self, a, a_split, b, b_split, configs, phase, amax_a=None, amax_b=None):
        """(Â/s_A)(B̂/s_B) for a (M, K), b (K, P) of one dtype: (M, P) in that dtype, and the two amaxes.

        a_split, b_split: the dimension of each operand that is split over the ranks (or None); amax_a,
        amax_b: amaxes already known (tensorwise, from another product), else computed here, and those
        whose elements lie on several ranks reduced together in one all-reduce."""
        rows, cols = a.shape[0], b.shape[1]
        a, b = _padded(a), _padded(b)  # zeros: no amax, no product changes
        amaxes = self.amaxes(a, a_split, b, b_split, configs, phase, amax_a, amax_b)
        a8, scale_a, b8, scale_b = self.cast(a, b, configs, amaxes)
        out = self.multiply(a8, scale_a, b8, scale_b, a.dtype, configs[2].use_fast_accum)  # (M, P)
        if out.shape != (rows, cols):
            out = out[:rows, :cols].contiguous()  # (M, P): a reduction of it runs in place
        return out, amaxes

    def amaxes(self, a, a_split, b, b_split, configs, phase, amax_a=None, amax_b=None) -> tuple:
        """The amaxes of a (M, K) and b (K, P) by their casts' granularity (tensorwise: (); rowwise: A's rows
        (M, 1), B's columns (1, P)), those not given computed, and those of split elements reduced together."""
        cast_a, cast_b, _ = configs
        dims = (None if _tensorwise(cast_a) else 1, None if _tensorwise(cast_b) else 0)
        amaxes = [amax_a, amax_b]
        todo = [i for i in (0, 1) if amaxes[i] is None]
        for i in todo:
            amaxes[i] = _amax((a, b)[i], dims[i])
        shared = [i for i in todo if _spread((a_split, b_split)[i], dims[i])]
        if shared:
            joined = self.reduce_max(torch.cat([amaxes[i].reshape(-1) for i in shared]), phase)
            for i, piece in zip(shared, joined.split([amaxes[i].numel() for i in shared])):
                amaxes[i] = piece.view(amaxes[i].shape)
        return tuple(amaxes)

    def cast(self, a, b, configs, amaxes) -> tuple:
        """(Â, s_A, B̂, s_B): a (M, K) and b (K, P) scaled by s = f_max / amax and cast to their float8 formats,
        Â row-major and B̂ column-major, as _scaled_mm takes them."""
        cast_a, cast_b, _ = configs
        scale_a = amax_to_scale(amaxes[0], cast_a.target_dtype, self.power_of_2)  # () or (M, 1)
        scale_b = amax_to_scale(amaxes[1], cast_b.target_dtype, self.power_of_2)  # () or (1, P)
        a8 = cast_to_float8(a, scale_a, cast_a.target_dtype, transposed=False)  # (M, K) row-major
        b8 = cast_to_float8(b, scale_b, cast_b.target_dtype, transposed=True).t()  # (K, P) column-major
        return a8, scale_a, b8, scale_b


class Float8Grads:
    """The backward products of one micro batch's g: input_grad(W) = g W and weight_grad(x) = gᵀ x, kept
    apart (the weight gradient may run later, or while a reduction runs); g's tensorwise amax is
    computed once and serves both."""

    def __init__(self, matmuls: Float8Matmuls, g: torch.Tensor, kept: tuple):
        self.matmuls, self.g = matmuls, g  # (N, n)
        tensorwise = [_tensorwise(c) for c in matmuls.forward_configs[:2]]
        known = iter(kept)
        self.amax_x, self.amax_w = (next(known) if t else None for t in tensorwise)
        self.amax_g = None

    def input_grad(self, w: torch.Tensor) -> torch.Tensor:
        """∂L/∂x = g W: (N, n) × (n, k) → (N, k)."""
        m = self.matmuls
        grad_x, (amax_g, _) = m.product(self.g, m.g_split, w, m.w_split, m.input_grad_configs, "backward",
                                        self._known_g(m.input_grad_configs[0]),
                                        self.amax_w if _tensorwise(m.input_grad_configs[1]) else None)
        self._keep_g(amax_g, m.input_grad_configs[0])
        return grad_x

    def weight_grad(self, x: torch.Tensor) -> torch.Tensor:
        """∂L/∂W = gᵀ x: (n, N) × (N, k) → (n, k)."""
        m = self.matmuls
        grad_w, (amax_g, _) = m.product(self.g.t(), _flip(m.g_split), x, m.x_split, m.weight_grad_configs,
                                        "backward", self._known_g(m.weight_grad_configs[0]),
                                        self.amax_x if _tensorwise(m.weight_grad_configs[1]) else None)
        self._keep_g(amax_g, m.weight_grad_configs[0])
        return grad_w

    def _known_g(self, cast) -> torch.Tensor | None:
        return self.amax_g if _tensorwise(cast) else None

    def _keep_g(self, amax: torch.Tensor, cast) -> None:
        if _tensorwise(cast):
            self.amax_g = amax


def scaled_mm(a8, scale_a, b8, scale_b, dtype: torch.dtype, fast_accumulation: bool) -> torch.Tensor:
    """(Â/s_A)(B̂/s_B) by torch._scaled_mm (through torchao's addmm_float8_unwrapped), in `dtype`; fast
    accumulation where the recipe asks for it (the forward's, on the GPU)."""
    return addmm_float8_unwrapped(a8, scale_a, b8, scale_b, dtype, use_fast_accum=fast_accumulation)


def inverse_scaled_mm(a8, inverse_a, b8, inverse_b, dtype: torch.dtype, fast_accumulation: bool,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """(Â·s_A⁻¹)(B̂·s_B⁻¹) (+ bias) by torch._scaled_mm, tensorwise, its inverse scales given (made once for the many
    products of one operand: parallel/ring_operands.py), the bias added in the product's epilogue."""
    if dtype == torch.float32 and bias is not None:  # _scaled_mm takes no bias with an fp32 output
        return torch._scaled_mm(a8, b8, scale_a=inverse_a, scale_b=inverse_b, out_dtype=dtype,
                                use_fast_accum=fast_accumulation) + bias
    return torch._scaled_mm(a8, b8, scale_a=inverse_a, scale_b=inverse_b, bias=bias, out_dtype=dtype,
                            use_fast_accum=fast_accumulation)


def emulated_mm(a8, scale_a, b8, scale_b, dtype: torch.dtype, fast_accumulation: bool) -> torch.Tensor:
    """(Â/s_A)(B̂/s_B) as torchao emulates it: the float8 values (exact in fp32) divided by their scales,
    multiplied in fp32 (also under autocast, as generation runs), rounded to `dtype`
    (model.modes.Float8.emulate)."""
    with torch.autocast(a8.device.type, enabled=False):
        return torch.mm(a8.float() / scale_a, b8.float() / scale_b).to(dtype)


def _padded(t: torch.Tensor) -> torch.Tensor:
    """t (R, C) with zero rows and columns up to multiples of ALIGN (t itself when already aligned)."""
    rows, cols = -t.shape[0] % ALIGN, -t.shape[1] % ALIGN
    return torch.nn.functional.pad(t, (0, cols, 0, rows)) if rows or cols else t


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sat(t · s) in float8 `dtype`, computed in fp32 (t · s rounded once, to the float8 value)."""
    return to_fp8_saturated(t.float() * scale, dtype)


def cast_to_float8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """quantize(t, scale, dtype) for t (M, N), contiguous: (M, N), or with `transposed` its transpose (N, M). Eager,
    one fused kernel (float8_cast, below); compiled (model.compile), torchao's ops, which inductor fuses with the
    amax and the layers around them."""
    if torch.compiler.is_compiling():
        return _cast_in_torch(t, scale, dtype, transposed)
    return float8_cast(t, scale, dtype, transposed)


@torch.library.custom_op("gpt3d::float8_cast", mutates_args=())
def float8_cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """cast_to_float8's eager form: on CUDA one Triton kernel reads t once and writes the float8 values in the layout
    asked for (model/float8_cast_triton.py, equal to torchao's cast bit for bit); elsewhere torchao's ops."""
    if t.is_cuda:
        from model import float8_cast_triton  # triton is imported only when the kernel runs

        return float8_cast_triton.quantize(t, scale, dtype, transposed)
    return _cast_in_torch(t, scale, dtype, transposed)


def _cast_in_torch(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    q = quantize(t, scale, dtype)  # (M, N)
    return q.t().contiguous() if transposed else q.contiguous()


@float8_cast.register_fake
def _(t, scale, dtype, transposed):
    rows, cols = t.shape
    return t.new_empty((cols, rows) if transposed else (rows, cols), dtype=dtype)


def float8_scales(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, 1/s) for fp32 amaxes (a few numbers): s = amax_to_scale(amax) (torchao's, with its power-of-two
    rounding when asked), 1/s the inverse scale torch._scaled_mm multiplies by. Eager without the rounding, one
    kernel (scales_in_one_kernel); compiled, or rounded to powers of two, torch's ops. Either way each of the
    scales starts 16 bytes from the next (_aligned_like)."""
    if power_of_2 or torch.compiler.is_compiling():
        return _scales_in_torch(amax, dtype, power_of_2)
    return scales_in_one_kernel(amax, dtype)


SCALE_APART = 4  # floats between two scales of one float8_scales call: each 16-byte aligned, as cuBLAS may need


@torch.library.custom_op("gpt3d::float8_scales", mutates_args=())
def scales_in_one_kernel(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_scales' eager form: on CUDA one Triton kernel (model/float8_scale_triton.py, equal to torch's ops bit
    for bit); elsewhere torch's ops. Each scale a product takes starts 16 bytes from the next (_aligned_like)."""
    if not amax.is_cuda:
        return _scales_in_torch(amax, dtype, False)
    from model import float8_scale_triton  # triton is imported only when the kernel runs

    scale, inverse = _aligned_like(amax), _aligned_like(amax)
    float8_scale_triton.scales_into(amax, dtype, scale, inverse)
    return scale, inverse


def _scales_in_torch(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, 1/s) by torchao's amax_to_scale and torch's reciprocal, copied into _aligned_like's layout."""
    scale = amax_to_scale(amax, dtype, power_of_2)
    return _aligned_like(amax).copy_(scale), _aligned_like(amax).copy_(scale.reciprocal())


def _aligned_like(amax: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor shaped like `amax`, its elements SCALE_APART floats apart."""
    return amax.new_empty((amax.numel(), SCALE_APART), dtype=torch.float32)[:, 0].view(amax.shape)


@scales_in_one_kernel.register_fake
def _(amax, dtype):
    return _aligned_like(amax), _aligned_like(amax)


def _amax(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """max |t| over all of t (dim None: a 0-dim tensor) or along dim (kept as size 1), in fp32: one reduction
    (the infinity norm; torchao's tensor_to_amax takes |t| first, a pass more), the same value exactly."""
    if dim is None:
        return torch.linalg.vector_norm(t, ord=float("inf"), dtype=torch.float32)
    return torch.linalg.vector_norm(t, ord=float("inf"), dim=dim, keepdim=True, dtype=torch.float32)


def _spread(split: int | None, dim: int | None) -> bool:
    """Whether the elements one amax covers lie on several ranks: an amax over the whole tensor (dim None)
    of a split tensor, or along the split dimension."""
    return split is not None and (dim is None or dim == split)


def _flip(split: int | None) -> int | None:
    """The split dimension of a 2-D tensor's transpose."""
    return None if split is None else 1 - split


def _tensorwise(cast) -> bool:
    return cast.scaling_granularity is ScalingGranularity.TENSORWISE
