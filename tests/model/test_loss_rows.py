"""The fused loss's two passes over a chunk of logits (model/loss_rows.py) against float64: the rows'
softmax statistics and their scaled cross-entropy gradient, with padding columns, ignored rows, targets
outside this shard's columns and logits scaled large; on the torch path here, and the Triton kernels
themselves through the interpreter (tests/model/test_loss_rows_triton.py)."""

import pytest
import torch

from model.loss_rows import row_grad_, row_stats

C, WIDTH, REAL = 7, 200, 150


def chunk(dtype, scale: float, seed: int = 0):
    """(z (C, WIDTH), targets, owned, per-row scale): rows 2 and 5 ignored (scale 0), row 4's target in
    another shard (not owned), padding columns REAL… filled with large values the softmax must never see."""
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(C, WIDTH, generator=gen, dtype=torch.float64) * scale)
    z[:, REAL:] = 1e4  # padding: must stay out of every statistic
    targets = torch.randint(0, REAL, (C,), generator=gen)
    owned = torch.ones(C, dtype=torch.bool)
    owned[[2, 4, 5]] = False
    row_scale = torch.full((C,), 1 / 5, dtype=torch.float32)
    row_scale[[2, 5]] = 0
    return z.to(dtype), targets, owned, row_scale


def float64_reference(z, targets, owned, row_scale):
    """(m, s, t, g) in float64 from the exact values of z."""
    real = z[:, :REAL].double()
    m = real.max(dim=-1).values
    s = torch.exp(real - m[:, None]).sum(dim=-1)
    t = torch.where(owned, real.gather(-1, targets[:, None]).squeeze(-1), 0.0)
    g = torch.softmax(real, dim=-1)
    g[owned, targets[owned]] -= 1
    g = torch.cat([g * row_scale.double()[:, None], torch.zeros(C, WIDTH - REAL, dtype=torch.float64)], dim=1)
    return m, s, t, g


def check(stats, grad, reference, tolerance):
    m, s, t = stats
    ref_m, ref_s, ref_t, ref_g = reference
    assert all(x.dtype == torch.float32 for x in stats)
    torch.testing.assert_close(m.double(), ref_m, rtol=1e-6, atol=0)
    torch.testing.assert_close(s.double(), ref_s, rtol=1e-5, atol=0)
    torch.testing.assert_close(t.double(), ref_t, rtol=1e-6, atol=0)
    assert torch.count_nonzero(grad[:, REAL:]) == 0  # padding: exactly zero
    assert torch.count_nonzero(grad[[2, 5]]) == 0  # ignored rows: exactly zero
    error = (grad.double() - ref_g).norm() / ref_g.norm()
    assert error <= tolerance, error


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["unit", "large"])
def test_row_stats_and_gradient_equal_float64(dtype, tolerance, scale):
    z, targets, owned, row_scale = chunk(dtype, scale)
    reference = float64_reference(z, targets, owned, row_scale)
    stats = row_stats(z, targets, owned, REAL)
    row_grad_(z, targets, owned, stats[0], stats[1], row_scale, REAL)  # z is now the gradient, in place
    check(stats, z, reference, tolerance)


def test_the_ops_pass_the_library_checks():
    z, targets, owned, row_scale = chunk(torch.float32, 1.0)
    torch.library.opcheck(row_stats, (z, targets, owned, REAL))
    m, s, _ = row_stats(z, targets, owned, REAL)
    torch.library.opcheck(row_grad_, (z.clone(), targets, owned, m, s, row_scale, REAL))


def test_the_cpu_path_in_blocks_of_rows_equals_float64(monkeypatch):
    """The torch path takes a block of rows at a time (model/loss_rows.py CPU_BLOCK_ELEMENTS); with blocks of two
    rows (and a last one of one) every block's statistics and gradient land in their own rows."""
    monkeypatch.setattr("model.loss_rows.CPU_BLOCK_ELEMENTS", 2 * REAL)
    z, targets, owned, row_scale = chunk(torch.float32, 30.0, seed=1)
    reference = float64_reference(z, targets, owned, row_scale)
    stats = row_stats(z, targets, owned, REAL)
    row_grad_(z, targets, owned, stats[0], stats[1], row_scale, REAL)
    check(stats, z, reference, 1e-6)
