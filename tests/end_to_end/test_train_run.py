"""`python -m train` end to end, as a user runs it: metrics, W&B, checkpoints, exact resume, errors."""

from __future__ import annotations

import math

import pytest

import wandb_log
from cli import metrics, write_corpus
from cli import train as run_train

# 2 layers, micro batches of 2 (accumulation 2), shorter warmup: the one-process path in detail.
ONE_PROCESS = ["model.n_layer=2", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def train(run_dir, corpus, *overrides, check=True):
    return run_train(run_dir, corpus, *ONE_PROCESS, *overrides, check=check)


def test_run_writes_metrics_wandb_checkpoints_and_a_sample(tmp_path, corpus):
    run_dir = tmp_path / "run"
    proc = train(run_dir, corpus, "train.max_steps=6", "train.eval_interval=3", "train.checkpoint_interval=3", "train.sample_tokens=8")
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["tokens"] for r in rows] == [128 * s for s in range(1, 7)]  # 4 sequences × 32 tokens per step
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/tflops", "perf/mfu"):
        assert all(key in r for r in rows), key
    assert all(r["train/grad_norm"] > 0 and r["perf/tokens_per_s"] > 0 for r in rows)
    assert [r["step"] for r in rows if "val/loss" in r] == [3, 6]
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    # learning rate: linear warmup over 32 tokens is done by step 1; then cosine towards the floor
    assert rows[0]["train/lr"] == pytest.approx(3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 96 / 1968))), rel=1e-4)
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step00000006"
    assert (ckpt / "step00000003").is_dir() and (ckpt / "step00000006").is_dir()
    assert "sample:" in proc.stdout
    # the same numbers reached the offline W&B run
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = [h for h in wandb_log.history(wandb_file) if "train/loss" in h]
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert [h["train/loss"] for h in history] == [r["train/loss"] for r in rows]
    assert [h["val/loss"] for h in history if "val/loss" in h] == [r["val/loss"] for r in rows if "val/loss" in r]


def test_resume_continues_bit_for_bit(tmp_path, corpus):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    common = ("train.eval_interval=0", "train.sample_tokens=0", "logging.wandb.mode=disabled")
    train(straight, corpus, "train.max_steps=6", "train.checkpoint_interval=0", *common)
    train(stopped, corpus, "train.max_steps=3", "train.checkpoint_interval=0", *common)
    proc = train(stopped, corpus, "train.max_steps=6", "train.checkpoint_interval=0", *common)
    assert "resumed from" in proc.stdout
    expected = [(r["step"], r["train/loss"], r["train/lr"], r["train/grad_norm"]) for r in metrics(straight)]
    got = [(r["step"], r["train/loss"], r["train/lr"], r["train/grad_norm"]) for r in metrics(stopped)]
    assert got == expected  # exact equality: same floats, not approximately


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.n_head=3"], "model.d_model=32 is not divisible by model.n_head=3"),
        (["train.micro_batch_size=3"], "train.global_batch_size=4 is not divisible by train.micro_batch_size=3"),
        (["data.paths=[/nonexistent/corpus/*.txt]"], "/nonexistent/corpus/*.txt"),
        (["parallel.tp=2"], "parallel.tp=2"),
        (["model.activation=swish"], "model.activation='swish': must be one of ['gelu', 'relu']"),
        (["parallel.tp=0"], "parallel.tp=0: must be a positive integer"),
        (["model.vocab_size=1000"], "model.vocab_size=1000 is smaller than the GPT-2 BPE's 50257 tokens"),
        (["train.seed=-1"], "train.seed=-1: must be an integer in [0, 2^31)"),
        (["optim.min_lr_ratio=5"], "optim.min_lr_ratio=5: must be in [0, 1]"),
        (["optim.lr=null", "model.name=mine"], "optim.lr is null and model.name='mine' has no paper LR"),
        (["train.resume=/nonexistent/ckpt"], "train.resume='/nonexistent/ckpt': no gpt3d checkpoint there"),
    ],
)
def test_bad_config_fails_before_work_and_leaves_nothing(tmp_path, corpus, overrides, message):
    run_dir = tmp_path / "bad"
    proc = train(run_dir, corpus, *overrides, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_unknown_key_is_rejected_by_hydra(tmp_path, corpus):
    proc = train(tmp_path / "bad", corpus, "train.max_step=5", check=False)
    assert proc.returncode != 0
    assert "train.max_step" in proc.stderr
