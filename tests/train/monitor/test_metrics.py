"""FLOP counting and MFU (PaLM's formula), against hand-computed values."""

import pytest

from model import flops_per_token
from train.monitor.metrics import mfu


def test_palm_flops_per_token():
    # 6N + 12·L·d·T with N=125M, L=12, d=768, T=2048
    assert flops_per_token(125_000_000, 12, 768, 2048) == 6 * 125_000_000 + 12 * 12 * 768 * 2048


def test_mfu_uses_all_devices_and_is_none_without_a_peak():
    # 1e5 tokens/s × 1e9 FLOPs/token = 1e14 FLOP/s over 2 devices of 100 TFLOP/s peak = 50%
    assert mfu(1e5, 10**9, 100.0, 2) == pytest.approx(0.5)
    assert mfu(1e5, 10**9, None, 1) is None


def test_resuming_drops_records_logged_after_the_checkpoint(tmp_path):
    import json

    from train.config.sections.logging import LoggingConfig, WandbConfig
    from train.monitor.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in range(1, 6)))
    settings = LoggingConfig(wandb=WandbConfig(mode="disabled", project="p"), curves=False)
    logger = MetricsLogger(tmp_path, settings, {}, active=True, resumed_step=3)
    logger.log({"step": 4, "train/loss": 0.5})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
