"""A run's curves (train/monitor/charts.py): the PNG shows each run's series against tokens, and carries them."""

from __future__ import annotations

import json

import pytest

from train.monitor.charts import METRICS, CurvesError, after_run, draw, read_back, series


def write_metrics(run_dir, records):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def records(scale: float) -> list[dict]:
    """Four records of 128 tokens each, validation at steps 2 and 4, a missing gradient norm at step 1."""
    return [{"step": s, "tokens": 128 * s, "train/loss": scale * (10 - s), "train/lr": 1e-3 / s,
             "train/grad_norm": None if s == 1 else 0.5 * s, "perf/tokens_per_s": 1000.0 + s,
             **({"val/loss": scale * (11 - s)} if s % 2 == 0 else {})} for s in range(1, 5)]


def test_the_png_carries_every_series_of_every_run_against_tokens(tmp_path):
    a, b = write_metrics(tmp_path / "a", records(1.0)), write_metrics(tmp_path / "b", records(2.0))
    png = draw([a, b], tmp_path / "both.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    got = read_back(png)
    assert [run["run"] for run in got["runs"]] == [str(a), str(b)]
    for run, scale in zip(got["runs"], (1.0, 2.0)):
        assert set(run["series"]) == set(METRICS)
        assert run["series"]["train/loss"] == [[128, 256, 384, 512], [scale * 9, scale * 8, scale * 7, scale * 6]]
        assert run["series"]["val/loss"] == [[256, 512], [scale * 9, scale * 7]]
        assert run["series"]["train/grad_norm"] == [[256, 384, 512], [1.0, 1.5, 2.0]]  # the missing one left out
        assert run["series"]["train/lr"][1] == pytest.approx([1e-3, 5e-4, 1e-3 / 3, 2.5e-4])
        assert run["series"]["perf/tokens_per_s"] == [[128, 256, 384, 512], [1001.0, 1002.0, 1003.0, 1004.0]]
    assert series(a) == got["runs"][0]["series"]


def test_a_folder_without_metrics_is_refused_and_a_run_ends_with_its_curves_path(tmp_path):
    with pytest.raises(CurvesError, match="holds no metrics.jsonl"):
        draw([tmp_path], tmp_path / "x.png")
    run = write_metrics(tmp_path / "run", records(1.0))
    assert after_run(run) == f"curves: {run / 'curves.png'}"
    assert read_back(run / "curves.png")["runs"][0]["series"] == series(run)
