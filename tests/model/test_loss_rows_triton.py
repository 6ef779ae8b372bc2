"""The fused loss's Triton kernels (model/loss_rows_triton.py), the ones CUDA runs, on the CPU through
TRITON_INTERPRET=1, against float64 (tests/model/test_loss_rows.py's cases): blocks of 64 columns, so each
row crosses several blocks and a ragged last one, padding columns and a target in another shard."""

import os
import sys

# As tests/model/test_attention_triton.py: triton reads TRITON_INTERPRET when it is first imported.
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/model/test_loss_rows_triton.py could set "
                       "TRITON_INTERPRET=1; run this file in a pytest process of its own")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from test_loss_rows import REAL, chunk, check, float64_reference  # noqa: E402

from model import loss_rows_triton  # noqa: E402


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["unit", "large"])
def test_the_kernels_equal_float64(dtype, tolerance, scale):
    assert loss_rows_triton.INTERPRET and loss_rows_triton.BLOCK_V < REAL
    z, targets, owned, row_scale = chunk(dtype, scale, seed=1)
    reference = float64_reference(z, targets, owned, row_scale)
    stats = loss_rows_triton.row_stats(z, targets, owned, REAL)
    loss_rows_triton.row_grad_(z, targets, owned, stats[0], stats[1], row_scale, REAL)
    check(stats, z, reference, tolerance)
