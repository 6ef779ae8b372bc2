"""A metrics record that cannot be written (metrics.jsonl unwritable, W&B failing) never stops training:
the first failure of each target is one warning, the records lost are counted and said when the logger
closes."""

import json

from train.config.sections.logging import LoggingConfig, WandbConfig
from train.monitor.metrics import MetricsLogger


def logger(run_dir) -> MetricsLogger:
    settings = LoggingConfig(wandb=WandbConfig(mode="disabled"), curves=False)
    return MetricsLogger(run_dir, settings, {}, active=True, resumed_step=None)


def warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpt3d: warning:")]


def test_an_unwritable_metrics_file_warns_once_and_counts(tmp_path, capsys):
    log = logger(tmp_path)
    log.log({"step": 1, "train/loss": 2.0})
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()  # opening it for appending fails now (IsADirectoryError)
    for step in (2, 3, 4):
        log.log({"step": step, "train/loss": 1.0})
    assert warnings(capsys) == ["gpt3d: warning: metrics.jsonl cannot be written (Is a directory); training goes on, "
                                "and what it cannot take is counted"]
    log.close()
    assert warnings(capsys) == ["gpt3d: warning: writes that failed and were skipped: 3 to metrics.jsonl (of 4 "
                                "metrics records this start)"]


class FailingRun:
    """A W&B run whose every call fails, as when its files or its service cannot take more."""

    summary = {}

    def log(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    def finish(self):
        raise RuntimeError("the W&B service is gone")


def test_a_failing_wandb_run_warns_once_and_counts(tmp_path, capsys):
    log = logger(tmp_path)
    log.run = FailingRun()
    for step in (1, 2):
        log.log({"step": step, "train/loss": 1.0})
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert warnings(capsys) == ["gpt3d: warning: W&B cannot be written (No space left on device); training goes on, "
                                "and what it cannot take is counted"]
    log.close()  # its finish fails too: counted
    assert warnings(capsys) == ["gpt3d: warning: writes that failed and were skipped: 3 to W&B (of 2 metrics "
                                "records this start)"]
