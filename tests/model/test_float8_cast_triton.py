"""The fused float8 cast (model/float8_cast_triton.py), the kernel CUDA runs, on the CPU through TRITON_INTERPRET=1,
against torchao's saturated cast (model/float8.py's quantize) bit for bit: both float8 formats, one scale for the
tensor or one per row or per column, bf16 and fp32 operands, strided ones (a transposed view, as gᵀ enters the
weight gradient), shapes that leave ragged tiles, values past f_max (saturated), ties and values that round up
into the next binade, subnormals and zeros; row-major and transposed outputs. And the scales' kernel
(model/float8_scale_triton.py) against torchao's amax_to_scale and torch's reciprocal, bit for bit."""

import os
import sys

# As tests/model/test_attention_triton.py: triton reads TRITON_INTERPRET when it is first imported.
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/model/test_float8_cast_triton.py could set "
                       "TRITON_INTERPRET=1; run this file in a pytest process of its own")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from model import float8_cast_triton, float8_scale_triton  # noqa: E402
from model.float8 import _aligned_like, quantize  # noqa: E402
from model.float8_library import amax_to_scale  # noqa: E402

FORMATS = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _operand(dtype: torch.dtype, f_max: float, seed: int) -> torch.Tensor:
    """(37, 53): normal values over many binades, some past f_max, exact ties, values just under a binade's top
    (which round into the next one), subnormals and zeros."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(37, 53, generator=g) * torch.exp2(torch.randint(-12, 12, (37, 53), generator=g).float())
    t[0, :10] = torch.tensor([0.0, -0.0, f_max * 1.5, -f_max * 3, f_max, 127.9, -127.8, 2.0**-9, 2.0**-17, 1.0625])
    t[1, :4] = torch.tensor([104.0, 112.0, 3 * 2.0**-10, 5 * 2.0**-18])  # ties between float8 neighbours
    return t.to(dtype)


def _scales(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"tensor": torch.tensor(1.0), "tensor-odd": torch.tensor(0.37), "rows": torch.rand(37, 1, generator=g) * 4,
            "columns": torch.rand(1, 53, generator=g) * 4}


@pytest.mark.parametrize("fp8", list(FORMATS), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "transposed"])
def test_the_kernel_equals_torchaos_cast_bit_for_bit(fp8, dtype, transposed):
    assert float8_cast_triton.INTERPRET and 37 % float8_cast_triton.BLOCK and 53 % float8_cast_triton.BLOCK
    t = _operand(dtype, FORMATS[fp8], seed=1)
    for operand in (t, t.t().contiguous().t()):  # row-major, and a strided view of the same values
        for name, scale in _scales(seed=2).items():
            got = float8_cast_triton.quantize(operand, scale, fp8, transposed)
            want = quantize(operand, scale, fp8)
            want = want.t().contiguous() if transposed else want
            assert got.is_contiguous() and got.shape == want.shape, name
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, operand.stride())


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="float8 cast to torch.float16: must be one of"):
        float8_cast_triton.quantize(torch.ones(2, 2), torch.tensor(1.0), torch.float16, False)


@pytest.mark.parametrize("fp8", list(FORMATS), ids=["e4m3", "e5m2"])
def test_the_scales_kernel_equals_torchaos_scale_and_torchs_reciprocal_bit_for_bit(fp8):
    """Amaxes over all binades (where 1/a·f_max and f_max/a round differently: torchao's two roundings are kept),
    under ε (floored to it), zero, infinite (s = 0, 1/s = inf) and NaN (kept); one, two, seventeen (a ragged block)
    and all 4,008 at a time; written 16 bytes apart, as model/float8.py lays them out."""
    g = torch.Generator().manual_seed(3)
    amax = torch.rand(4000, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-60, 60, (4000,), generator=g))
    amax = torch.cat([amax.float(), torch.tensor([0.0, 1e-13, 1e-12, 3e-12, float("inf"), float("nan"), 448.0, 1.0])])
    differ = (1 / amax.double()) * FORMATS[fp8] != FORMATS[fp8] / amax.double()
    assert differ.any()  # the two orders of rounding are told apart by these amaxes
    for count in (1, 2, 17, amax.numel()):
        scale, inverse = _aligned_like(amax[:count]), _aligned_like(amax[:count])
        float8_scale_triton.scales_into(amax[:count], fp8, scale, inverse)
        want = amax_to_scale(amax[:count], fp8)
        for got, expected in ((scale, want), (inverse, want.reciprocal())):
            assert torch.equal(got.view(-1, 1).view(torch.int32), expected.view(-1, 1).view(torch.int32)), count
        assert all(element.data_ptr() % 16 == 0 for element in (*scale, *inverse))


def test_the_scales_kernel_refuses_a_format_it_has_no_range_for():
    with pytest.raises(ValueError, match="float8 scales for torch.float16: must be"):
        float8_scale_triton.scales_into(torch.ones(2), torch.float16, _aligned_like(torch.ones(2)),
                                        _aligned_like(torch.ones(2)))
