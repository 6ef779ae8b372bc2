"""Non-finite steps through `python -m train`: skipped on every rank, counted, a stop after too many in a
row, and never a checkpoint of non-finite weights.

`optim.lr=1e6` makes the tiny model's loss NaN from its second step on (before: 13 NaN steps trained and
NaN checkpoints written). Each skipped step must leave everything the checkpoint holds (weights, Adam's
moments and step count, the LR scheduler) exactly as the checkpoint before it.
"""

from __future__ import annotations

import math

import pytest
import torch
import wandb_log
from checkpoint_state import non_finite_tensors, states_differ
from cli import metrics, train, write_corpus

from model.layers import flag_non_finite

NAN_RUN = ["optim.lr=1e6", "train.checkpoint_interval=1", "train.keep_checkpoints=100", "train.eval_interval=0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def step_folder(run_dir, step):
    return run_dir / "checkpoints" / f"step{step:08d}"


def check_skipped_run(run_dir, proc, limit: int) -> int:
    """The shared assertions; returns the first skipped step."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    rows = metrics(run_dir)
    counts = [r["train/skipped_steps"] for r in rows]
    first = counts.index(1) + 1  # steps are numbered from 1
    assert first >= 2
    last = first + limit - 1
    # every step after the first skip is skipped too (the weights stay the exploded ones), and the run stops
    assert [r["step"] for r in rows] == list(range(1, last + 1))
    assert counts == [0] * (first - 1) + list(range(1, limit + 1))
    assert all(math.isfinite(r["train/loss"]) for r in rows[: first - 1])
    assert all(r["train/loss"] is None and r["train/grad_norm"] is None for r in rows[first - 1:])
    # the LR schedule does not move on across skipped steps
    assert len({r["train/lr"] for r in rows[first - 1:]}) == 1
    assert rows[first - 1]["train/lr"] != rows[first - 2]["train/lr"]
    message = f"stopped at step {last}: steps {first}–{last} ({limit} in a row, train.max_consecutive_skips={limit})"
    assert message in proc.stderr and proc.stderr.count(message) == 1  # said once, by rank 0
    assert f"the weights are those after step {first - 1}" in proc.stderr
    assert "learning rate too high" in proc.stderr
    assert f"resume from the last checkpoint, {step_folder(run_dir, last - 1)} " in proc.stderr  # the run's newest
    assert "train/run/loop.py" not in proc.stderr  # no worker traceback (torchrun prints its own on a failed worker)
    # checkpoints up to the last complete step before the stop; all alike from the last applied step on
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step{last - 1:08d}"
    assert not step_folder(run_dir, last).exists()
    for step in range(first, last):
        assert states_differ(step_folder(run_dir, first - 1), step_folder(run_dir, step)) == [], step
    for step in range(1, last):
        assert non_finite_tensors(step_folder(run_dir, step)) == [], step
    return first


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path, corpus):
    run_dir = tmp_path / "run"
    proc = train(run_dir, corpus, *NAN_RUN, "train.max_steps=20", check=False)
    first = check_skipped_run(run_dir, proc, limit=5)  # the default train.max_consecutive_skips
    assert f"step {first}: loss nan, gradient norm nan: not finite, step skipped on every rank" in proc.stdout
    assert f"skipped 1" in proc.stdout  # the progress line
    # the count reached W&B too
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = [h for h in wandb_log.history(wandb_file) if "train/skipped_steps" in h]
    assert [h["train/skipped_steps"] for h in history] == [r["train/skipped_steps"] for r in metrics(run_dir)]


@pytest.mark.parametrize(
    "layout",
    [["parallel.zero_stage=2"], ["parallel.zero_stage=3"], ["parallel.pp=2"]],
    ids=["zero2", "zero3", "pp2"],
)
def test_every_layout_skips_on_every_rank(tmp_path, corpus, layout):
    """Two ranks: DeepSpeed's ZeRO optimizers (ZeRO-1 shares ZeRO-2's), and ClippingAdamW under the
    pipeline engine, whose last stage computes the loss inside DeepSpeed's schedule."""
    run_dir = tmp_path / "run"
    proc = train(run_dir, corpus, *NAN_RUN, "train.max_steps=10", "train.max_consecutive_skips=2",
                 "logging.wandb.mode=disabled", *layout, kind="torchrun", nproc=2, check=False)
    check_skipped_run(run_dir, proc, limit=2)


def test_a_non_finite_loss_reaches_the_gradient_and_a_finite_one_is_untouched():
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    loss = (w * 3).sum()
    flagged = flag_non_finite(loss)
    flagged.backward()
    assert torch.equal(flagged, loss) and torch.equal(w.grad, torch.tensor([3.0, 3.0]))  # bit for bit
    w.grad = None
    overflowed = (w * 3).sum() + torch.tensor(math.inf)  # its gradient alone would be finite
    flag_non_finite(overflowed).backward()
    assert w.grad.isnan().all()


def test_a_checkpoint_of_non_finite_weights_is_refused(tmp_path, corpus):
    """The first step's loss and gradient are finite, but its update overflows float32: AdamW's decoupled
    weight decay multiplies the matrices by 1 − lr·decay = 1 − 1e40."""
    run_dir = tmp_path / "run"
    proc = train(run_dir, corpus, "optim.lr=1e30", "optim.weight_decay=1e10", "train.max_steps=3", "train.checkpoint_interval=1",
                 "train.eval_interval=0", "logging.wandb.mode=disabled", check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert math.isfinite(metrics(run_dir)[0]["train/loss"])
    assert "step 1: refusing to write a checkpoint: the weights are not finite on 1 rank(s)" in proc.stderr
    assert "no checkpoint was written" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run_dir / "checkpoints").exists()
