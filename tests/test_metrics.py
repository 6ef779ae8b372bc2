"""FLOP counting and MFU (PaLM's formula), against hand-computed values."""

import pytest

from train.metrics import flops_per_token, mfu


def test_palm_flops_per_token():
    # 6N + 12·L·d·T with N=125M, L=12, d=768, T=2048
    assert flops_per_token(125_000_000, 12, 768, 2048) == 6 * 125_000_000 + 12 * 12 * 768 * 2048


def test_mfu_uses_all_devices_and_is_none_without_a_peak():
    # 1e5 tokens/s × 1e9 FLOPs/token = 1e14 FLOP/s over 2 devices of 100 TFLOP/s peak = 50%
    assert mfu(1e5, 10**9, 100.0, 2) == pytest.approx(0.5)
    assert mfu(1e5, 10**9, None, 1) is None
