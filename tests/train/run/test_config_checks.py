"""Config checks through `python -m train`: keys added with `+` that nothing defines, and what a resume
may change (train/run/schedule.py).

The resume cases share one 2-step run (checkpoint at step 2) and resume copies of it. Expected learning
rates come from GPT-3's schedule written out here (linear warmup, cosine to 10%), not from the code.
"""

from __future__ import annotations

import math
import shutil

import pytest
from cli import metrics, train, write_corpus

QUIET = ["train.eval_interval=0", "logging.wandb.mode=disabled"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("+train.max_step=5", "train.max_step is not a setting ('+' adds only keys that configs/ defines); "
                              "did you mean train.max_steps? valid keys of train: ["),
        ("+data.encodng=latin-1", "data.encodng is not a setting"),
        ("+logging.wandb.tag=[a]", "did you mean logging.wandb.tags?"),
        ("+seed=3", "seed is not a setting ('+' adds only keys that configs/ defines); valid keys of the top level: "
                    "['data', 'deepspeed', 'evaluate', 'logging', 'model', 'optim', 'parallel', 'train']"),
    ],
)
def test_keys_added_with_plus_must_exist(tmp_path, corpus, override, message):
    run_dir = tmp_path / "bad"
    proc = train(run_dir, corpus, override, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, corpus):
    """A run of 2 steps with lr 3e-3 and a checkpoint at its end, started where an earlier attempt was
    killed after logging its first step and before any checkpoint (that row must not stay)."""
    run_dir = tmp_path_factory.mktemp("two_steps") / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "tokens": 128, "train/loss": 10.0}\n')
    train(run_dir, corpus, "train.max_steps=2", *QUIET)
    return run_dir


def resumed(two_steps, tmp_path, corpus, *overrides, check=True):
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    return run_dir, train(run_dir, corpus, *QUIET, *overrides, check=check)


def gpt3_lr(peak: float, warmup: int, decay: int, tokens: int) -> float:
    if tokens < warmup:
        return peak * tokens / warmup
    progress = min((tokens - warmup) / (decay - warmup), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def test_another_model_shape_is_refused_before_anything_is_built(two_steps, tmp_path, corpus):
    run_dir, proc = resumed(two_steps, tmp_path, corpus, "train.max_steps=3", "model.n_layer=2", "model.d_model=64",
                            check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "holds another model: it was saved with model.d_model=32 (now 64), model.n_layer=3 (now 2)" in proc.stderr
    assert "model toy" not in proc.stdout  # nothing was built
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]  # once each (see two_steps)


def test_a_changed_schedule_is_kept_from_the_checkpoint_and_said(two_steps, tmp_path, corpus):
    """Another lr, batch and length: the run goes on to the new max_steps with the checkpoint's lr and batch."""
    run_dir, proc = resumed(two_steps, tmp_path, corpus, "train.max_steps=4", "optim.lr=1e-3",
                            "train.global_batch_size=8")
    note = "train.max_steps 2 → 4, train.global_batch_size 4 → 8, optim.lr 0.003 → 0.001: keeping the checkpoint's schedule"
    assert note in proc.stdout and "train.reset_schedule=true" in proc.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["tokens"] for r in rows] == [128, 256, 384, 512]  # still 4 sequences of 32 tokens per step
    # the 2-step run's schedule: peak 3e-3, warmup 32 tokens as TINY sets it (set by hand: not capped at a tenth
    # of the run's 256 tokens), decay over 2000
    for r in rows[2:]:
        assert r["train/lr"] == pytest.approx(gpt3_lr(3e-3, 32, 2000, r["tokens"]), rel=1e-9)


def test_a_batch_ramp_added_on_resume_is_kept_out_with_the_schedule(two_steps, tmp_path, corpus):
    """The batch each step trains on is part of the kept schedule: a ramp set on resume does not apply."""
    run_dir, proc = resumed(two_steps, tmp_path, corpus, "train.max_steps=4", "train.batch_ramp.start=2",
                            "train.batch_ramp.tokens=256")
    assert "train.batch_ramp.start None → 2, train.batch_ramp.tokens None → 256: keeping the checkpoint's schedule" \
        in proc.stdout, proc.stdout
    rows = metrics(run_dir)
    assert [r["tokens"] for r in rows] == [128, 256, 384, 512]  # 4 sequences of 32 tokens, as before
    assert [r["train/batch_size"] for r in rows[2:]] == [4, 4]


def test_reset_schedule_follows_the_new_values(two_steps, tmp_path, corpus):
    run_dir, proc = resumed(two_steps, tmp_path, corpus, "train.max_steps=4", "optim.lr=1e-3",
                            "train.reset_schedule=true")
    assert "optim.lr 0.003 → 0.001: train.reset_schedule=true: the new schedule applies from the step reached" in proc.stdout
    rows = metrics(run_dir)
    # the 4-step schedule at the step reached: peak 1e-3, warmup 32 tokens as set
    for r in rows[2:]:
        assert r["train/lr"] == pytest.approx(gpt3_lr(1e-3, 32, 2000, r["tokens"]), rel=1e-9)


@pytest.mark.parametrize(
    "override, message",
    [
        ("logging.wandb.tags=5", "logging.wandb.tags=5: must be a list of words"),
        ("logging.wandb.tags=solo", "logging.wandb.tags='solo': must be a list of words"),
        ("logging.wandb.tags=[a,'']", "must be a list of words"),
        ("logging.wandb.tags=[a,3]", "must be a list of words"),
        ("logging.wandb.group=5", "logging.wandb.group=5: must be text (or null)"),
        ("logging.wandb.mode=sometimes", "logging.wandb.mode='sometimes': must be one of ['offline', 'online', 'disabled']"),
        ("logging.wandb.log_checkpoints=maybe", "logging.wandb.log_checkpoints='maybe': must be true or false"),
    ],
)
def test_wandb_settings_of_the_wrong_kind_are_one_line(override, message):
    """What W&B would be handed is checked before the run starts (a ConfigError: the command exits 2),
    never a traceback from inside the check or from wandb.init."""
    from config_checks import refusal

    assert message in refusal([override])
    assert refusal(["logging.wandb.tags=[a,b]", "logging.wandb.group=g"]) is None  # valid: passes
