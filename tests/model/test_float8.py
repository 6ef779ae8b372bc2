"""model/float8.py: each float8 product against a float64 product of the same quantized operands.

The reference quantizes by the definition, written out here: for each operand of a product C = A B
(A (M, K), B (K, P)) the amax over the whole tensor (tensorwise) or over K per row of A and per column
of B (rowwise), s = f_max / amax (rowwise: rounded down to a power of two), Â = clamp(A·s, ±f_max) in
the recipe's float8 format (tensorwise: x and W e4m3, g e5m2; rowwise: all e4m3), then
C_ref = (Â/s_A)(B̂/s_B) in float64. The layer's bf16 product may differ from it only by its own rounding
to bf16 and fp32 accumulation, far below the float8 formats' steps (2^-4 for e4m3, 2^-3 for e5m2),
which the unquantized product is shown to miss by. Both kernels: torch._scaled_mm (what the GPU
runs, here on the CPU) and the emulation the CPU runs in training.
"""

from __future__ import annotations

import pytest
import torch

from model.float8 import Float8Matmuls
from model.modes import Float8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# the float8 format of x, W and g, per recipe
FORMATS = {"tensorwise": (E4M3, E4M3, E5M2), "rowwise": (E4M3, E4M3, E4M3)}
N, K, P = 48, 40, 24  # tokens, in features, out features; 40 and 24 are not multiples of 16: padded
BF16_ROUNDING = 2.0**-8  # one rounding to bf16 (8 significant bits), with its margin


def reference_quantized(t: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool) -> torch.Tensor:
    """The values Â/s that a product uses for t, in float64 (dim: the contraction dimension for rowwise)."""
    t = t.double()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = torch.finfo(dtype).max / amax.clamp(min=1e-12)
    if power_of_2:
        scale = 2.0 ** torch.floor(torch.log2(scale))
    scale = scale.float().double()  # the scale is an fp32 number
    top = torch.finfo(dtype).max
    return (t.float() * scale.float()).clamp(-top, top).to(dtype).double() / scale


def reference_product(a, a_dtype, b, b_dtype, recipe: str) -> torch.Tensor:
    rowwise = recipe == "rowwise"
    return reference_quantized(a, a_dtype, 1 if rowwise else None, rowwise) @ reference_quantized(
        b, b_dtype, 0 if rowwise else None, rowwise)


def assert_accumulation_close(got: torch.Tensor, expected: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """got within one bf16 rounding of expected, plus fp32 accumulation over K terms of |a||b|."""
    accumulation = a.shape[1] * 2.0**-24 * (a.double().abs() @ b.double().abs())
    error = (got.double() - expected).abs()
    assert (error <= BF16_ROUNDING * expected.abs() + accumulation).all(), error.max()


def operands(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=g) * torch.logspace(-2, 1, K)  # columns of different ranges
    w = torch.randn(P, K, generator=g) * 0.05
    grad = torch.randn(N, P, generator=g) * 1e-4 * torch.logspace(0, 3, N).unsqueeze(1)  # rows of different ranges
    return x.bfloat16(), w.bfloat16(), grad.bfloat16()


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_product_equals_the_float64_product_of_its_quantized_operands(recipe, emulate):
    x, w, g = operands(0)
    fx, fw, fg = FORMATS[recipe]
    matmuls = Float8Matmuls(Float8(recipe, emulate))
    y, kept = matmuls.forward(x.unsqueeze(0), w, None)  # (1, N, P)
    grads = matmuls.backward(g, kept)
    products = {
        "forward": (y[0], x, fx, w.t(), fw),
        "input grad": (grads.input_grad(w), g, fg, w, fw),
        "weight grad": (grads.weight_grad(x), g.t(), fg, x, fx),
    }
    for name, (got, a, a_dtype, b, b_dtype) in products.items():
        assert got.dtype == torch.bfloat16, name
        expected = reference_product(a, a_dtype, b, b_dtype, recipe)
        assert_accumulation_close(got, expected, a, b)
        unquantized = a.double() @ b.double()  # what the tolerance must tell apart from float8's
        with pytest.raises(AssertionError):
            assert_accumulation_close(got, unquantized, a, b)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_bias_is_added_after_the_product(recipe):
    x, w, _ = operands(1)
    bias = torch.linspace(-1, 1, P).bfloat16()
    matmuls = Float8Matmuls(Float8(recipe, emulate=True))
    with_bias, _ = matmuls.forward(x, w, bias)
    without, _ = matmuls.forward(x, w, None)
    assert torch.equal(with_bias, without + bias)


def aligned(n: int) -> int:
    """n padded to a multiple of 16, as the products pad their operands (rowwise amaxes of padding are 0)."""
    return -(-n // 16) * 16


# Which amaxes each layer kind all-reduces, and in which product: {recipe: {split: [(phase, elements)]}},
# the elements of one all-reduce being the amaxes of one product's operands whose elements lie on
# several ranks (model/float8.py's table).
REDUCED = {
    "tensorwise": {
        "out": [("forward", 1), ("backward", 1)],  # W; g (the weight gradient reuses g's and x's)
        "in": [("forward", 2)],  # x and W together; g is whole on every rank
    },
    "rowwise": {
        "out": [("backward", aligned(N) + aligned(K))],  # the input grad's contraction (n) is split: g's rows, W's columns
        "in": [("forward", aligned(N) + aligned(P))],  # the forward's contraction (k) is split: x's rows, W's rows
    },
}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("split", ["out", "in"], ids=["column", "row"])
def test_amaxes_are_reduced_exactly_where_their_elements_are_split(recipe, split):
    """One rank's view: the reduction is the identity here, only its calls are recorded."""
    x, w, g = operands(2)
    calls = []

    def reduce_max(amaxes, phase):
        calls.append((phase, amaxes.numel()))
        return amaxes

    matmuls = Float8Matmuls(Float8(recipe, emulate=True), split, reduce_max)
    y, kept = matmuls.forward(x, w, None)
    grads = matmuls.backward(g, kept)
    grads.input_grad(w)
    grads.weight_grad(x)
    assert calls == REDUCED[recipe][split]


def test_a_decoding_step_of_one_token_is_padded_not_refused():
    """_scaled_mm on the GPU takes dimensions that are multiples of 16; one token is padded to 16 rows."""
    x, w, _ = operands(3)
    one, _ = Float8Matmuls(Float8("tensorwise")).forward(x[:1], w, None)  # (1, P)
    assert one.shape == (1, P)
    assert_accumulation_close(one, reference_product(x[:1], E4M3, w.t(), E4M3, "tensorwise"), x[:1], w.t())


def test_a_block_computes_in_float8_exactly_the_linears_it_is_built_with():
    """model.modes.LayerModes.fp8_linears: the named linears get the float8 products, the others the plain ones;
    a name that is not a block linear is refused in one line."""
    from model import GPTConfig
    from model.gpt import make_layer
    from model.modes import LayerModes
    from model.recompute import MATMULS

    config = GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16, vocab_size=300)
    with torch.device("meta"):
        block = make_layer(config, 1, LayerModes(fp8=Float8("rowwise", True), fp8_linears={"attn.proj", "mlp.fc"}))
    kinds = {name: type(block.get_submodule(name).matmuls) for name in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert kinds == {"attn.qkv": type(MATMULS), "attn.proj": Float8Matmuls, "mlp.fc": Float8Matmuls,
                     "mlp.proj": type(MATMULS)}
    assert block.attn.proj.fp8 == Float8("rowwise", True) and block.attn.qkv.fp8 is None
    with pytest.raises(ValueError, match=r"fp8_linears=\['head'\]: must be distinct names of a block's linears"):
        LayerModes(fp8_linears=["head"])


@pytest.mark.parametrize("power_of_2", [False, True], ids=["exact", "power-of-2"])
def test_the_scales_op_gives_the_definitions_scale_and_inverse_16_bytes_apart(power_of_2):
    """model/float8.py's float8_scales against the definition above (s = f_max / max(amax, 1e-12), rounded down to
    a power of two when asked, an fp32 number; 1/s in fp32): equal, each element 16 bytes from the next (as cuBLAS may
    need a scale's pointer); the custom op passes torch.library.opcheck (its fake tensors agree with it)."""
    from model.float8 import float8_scales, scales_in_one_kernel

    amax = torch.tensor([3.0, 0.0, 448.0, 1e-30, 7.25e5])
    for dtype in (E4M3, E5M2):
        scale, inverse = float8_scales(amax, dtype, power_of_2)
        want = torch.finfo(dtype).max / amax.double().clamp(min=1e-12)
        want = (2.0 ** torch.floor(torch.log2(want)) if power_of_2 else want).float()
        assert torch.equal(scale, want) and torch.equal(inverse, want.reciprocal())
        assert all(element.data_ptr() % 16 == 0 for element in (*scale, *inverse))
    torch.library.opcheck(scales_in_one_kernel, (amax, E4M3))
