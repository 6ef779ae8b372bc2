"""`python -m train` end to end, as a user runs it: metrics, W&B, checkpoints, exact resume, errors."""

from __future__ import annotations

import base64
import hashlib
import json
import math

import pytest
import wandb_log
from cli import REPO, TINY, assert_same_losses, metrics, run_module, write_corpus
from cli import train as run_train

# 2 layers, micro batches of 2 (accumulation 2), shorter warmup: the one-process path in detail.
ONE_PROCESS = ["model.n_layer=2", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def train(run_dir, corpus, *overrides, check=True, kind="python"):
    return run_train(run_dir, corpus, *ONE_PROCESS, *overrides, check=check, kind=kind)


def test_run_writes_metrics_wandb_checkpoints_and_a_sample(tmp_path, corpus):
    run_dir = tmp_path / "run"
    proc = train(run_dir, corpus, "train.max_steps=6", "train.eval_interval=3", "train.checkpoint_interval=3", "train.sample_tokens=8",
                 kind="process")  # a fresh interpreter: what it prints at start-up too
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
    assert "Setting accelerator" not in proc.stderr  # DeepSpeed's warning that tells a CPU user nothing
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


def test_a_resumed_process_with_deterministic_triton_attention_continues_bit_for_bit(tmp_path, corpus):
    """The GPU's kernel path, on the Triton interpreter (TRITON_INTERPRET=1): the fused attention with its
    deterministic backward. A second process resumed from the first one's step-2 checkpoint computes
    step 3 to the same bits (its kernel choices are the first process's: model/kernel_choices.py)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("model.attention_impl=triton", "model.deterministic_attention=true", "train.max_steps=3",
              "train.eval_interval=0", "logging.wandb.mode=disabled", "optim.warmup_tokens=16")
    env = {"TRITON_INTERPRET": "1"}
    run_train(straight, corpus, *common, "train.checkpoint_interval=2", env=env)
    proc = run_train(resumed, corpus, *common, f"train.resume={straight}/checkpoints/step00000002", env=env)
    assert "resumed from" in proc.stdout
    keys = ("step", "train/loss", "train/lr", "train/grad_norm")
    assert [[r[k] for k in keys] for r in metrics(resumed)] == [[r[k] for k in keys] for r in metrics(straight)[2:]]


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


# --- one text file with the default data settings (long documents cut into pieces: train/data/pieces.py) ---

BOOK_DEFAULTS = [o for o in TINY if not o.startswith("data.")] + ["data=files"]  # every data.* at its default


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    """One .txt file of a few hundred KB: the source of seven standard-library modules, one after another."""
    import argparse, csv, inspect, logging, pathlib, string, textwrap  # noqa: E401

    path = tmp_path_factory.mktemp("book") / "book.txt"
    path.write_text("".join(inspect.getsource(m) for m in (argparse, csv, logging, pathlib, string, textwrap)))
    assert 200_000 < path.stat().st_size < 600_000
    return path


def book_run(run_dir, book, *overrides, kind="python", nproc=1, check=True):
    args = [f"hydra.run.dir={run_dir}", *BOOK_DEFAULTS, f"data.paths=[{book}]", "train.eval_interval=2",
            "train.checkpoint_interval=0", "logging.wandb.mode=disabled", *overrides]
    proc = run_module("train", args, kind, nproc)
    if check:
        assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_one_text_file_trains_with_default_data_settings_at_dp1_and_dp2_and_resumes_exactly(tmp_path, book):
    straight = book_run(tmp_path / "dp1", book, "train.max_steps=4")
    assert "data.streams" not in straight.stderr  # 4 streams fed: nothing lowered, nothing refused
    one = metrics(tmp_path / "dp1")
    assert [r["step"] for r in one if "val/loss" in r] == [2, 4]  # validation on the held-out end of the file
    book_run(tmp_path / "dp2", book, "train.max_steps=4", kind="ranks", nproc=2)
    two = metrics(tmp_path / "dp2")
    assert_same_losses(two, one)  # the same global batches at dp=2
    assert [r["val/loss"] for r in two if "val/loss" in r] == pytest.approx([r["val/loss"] for r in one if "val/loss" in r], rel=1e-5)
    book_run(tmp_path / "stopped", book, "train.max_steps=3")  # (2 steps would cap the 32-token warmup at 10%)
    resumed = book_run(tmp_path / "stopped", book, "train.max_steps=4")
    assert "resumed from" in resumed.stdout
    keys = ("step", "train/loss", "train/lr", "train/grad_norm")
    again = metrics(tmp_path / "stopped")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in one]  # exact
    assert [again[s - 1]["val/loss"] for s in (2, 4)] == [one[s - 1]["val/loss"] for s in (2, 4)]


# --- a run folder holds one run; W&B records what the run really was ---

WANDB = ["logging.wandb.group=ablation", "logging.wandb.tags=[tiny,cpu]", "logging.wandb.notes=a note",
         "logging.wandb.job_type=pretrain", "train.eval_interval=2", "train.checkpoint_interval=2"]


def _wandb_file(run_dir, run_id):
    (found,) = run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    return found


def checkpoints_logged(run_file: dict) -> list[dict]:
    """The checkpoint artifacts of a run file (wandb_log.run_file); the sample table is an artifact too."""
    return [a for a in run_file["artifacts"] if a["type"] == "checkpoint"]


def test_a_used_run_folder_is_refused_or_moved_aside_and_wandb_records_each_run(tmp_path, corpus):
    import subprocess as sp

    run_dir = tmp_path / "run"
    first = train(run_dir, corpus, "train.max_steps=4", "train.sample_tokens=8", *WANDB)
    first_id = (run_dir / "wandb_run_id").read_text().strip()
    first_metrics = (run_dir / "metrics.jsonl").read_bytes()
    rows = metrics(run_dir)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step*"))
    assert checkpoints == ["step00000002", "step00000004"]

    # W&B: the run file, read through W&B's own protobuf messages
    wandb_file = _wandb_file(run_dir, first_id)
    got = wandb_log.run_file(wandb_file)
    assert got["run"] == {"id": first_id, "name": f"toy-tp1pp1dp1-{run_dir.name}", "group": "ablation",
                          "tags": ["tiny", "cpu"], "notes": "a note", "job_type": "pretrain", "resumed": False}
    history = [h for h in wandb_log.history(wandb_file) if "train/loss" in h]
    assert [(h["_step"], h["tokens"], h["train/loss"]) for h in history] == [(r["step"], r["tokens"], r["train/loss"]) for r in rows]
    assert ("tokens", "") in got["metrics"] and ("train/*", "tokens") in got["metrics"] and ("val/*", "tokens") in got["metrics"]
    config = got["config"]
    commit = sp.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    run_info = config["run"]["value"] if "value" in config["run"] else config["run"]
    assert run_info["git_commit"] == commit and run_info["gpt3d_version"] == "0.1.0"
    assert run_info["layout"] == {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0, "micro_batch": 2, "activation_checkpointing": 0}
    assert run_info["global_batch_sequences"] == 4 and run_info["global_batch_tokens"] == 128
    optim = config["optim"]["value"] if "value" in config["optim"] else config["optim"]
    assert optim["lr"] == 3e-3 and optim["warmup_tokens"] == 32 and optim["decay_tokens"] == 2000
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert got["summary"]["val/loss_final"] == val[-1] and got["summary"]["val/loss_best"] == min(val)
    (sample,) = [h for h in wandb_log.history(wandb_file) if "samples/_type" in h]
    assert sample["_step"] == 4 and sample["samples/_type"] == "table-file" and sample["samples/nrows"] == 1
    table = json.loads((wandb_file.parent / "files" / sample["samples/path"]).read_text())
    printed = first.stdout.split("sample:\n", 1)[1].rstrip("\n")
    assert table["columns"] == ["step", "prompt", "sample"] and table["data"] == [[4, "The", printed]]

    # a fresh start in the used folder: one line, exit 2, nothing touched
    refused = train(run_dir, corpus, "train.max_steps=2", "train.resume=none", check=False)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "train.resume=auto" in refused.stderr and "train.resume=overwrite" in refused.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == first_metrics
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*")) == checkpoints

    # train.resume=overwrite: the old run moves aside whole; the new one starts clean with a new W&B id
    train(run_dir, corpus, "train.max_steps=2", "train.resume=overwrite", *WANDB)
    (aside,) = tmp_path.glob("run.replaced-*")
    assert (aside / "metrics.jsonl").read_bytes() == first_metrics
    assert sorted(p.name for p in (aside / "checkpoints").glob("step*")) == checkpoints
    assert (aside / "wandb_run_id").read_text().strip() == first_id and _wandb_file(aside, first_id)
    second_id = (run_dir / "wandb_run_id").read_text().strip()
    assert second_id != first_id and not list(run_dir.glob(f"wandb/*{first_id}*"))
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*")) == ["step00000002"]

    # the default resume continues the new run (step 2), under its W&B id, marked resumed; asked to, it
    # logs its checkpoint as an artifact holding exactly the folder's files
    resumed = train(run_dir, corpus, "train.max_steps=4", *WANDB, "logging.wandb.log_checkpoints=true")
    assert f"resumed from {run_dir / 'checkpoints' / 'step00000002'}" in resumed.stdout
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    segments = [wandb_log.run_file(f) for f in sorted(run_dir.glob(f"wandb/offline-run-*-{second_id}/*.wandb"))]
    assert [(s["run"]["id"], s["run"]["resumed"]) for s in segments] == [(second_id, False), (second_id, True)]
    assert checkpoints_logged(got) == [] and checkpoints_logged(segments[0]) == []  # off unless asked
    folder = run_dir / "checkpoints" / "step00000004"
    files = {p.relative_to(folder).as_posix(): (base64.b64encode(hashlib.md5(p.read_bytes()).digest()).decode(),
                                                p.stat().st_size)
             for p in folder.rglob("*") if p.is_file()}
    assert len(files) >= 3
    assert checkpoints_logged(segments[1]) == [{"type": "checkpoint", "name": f"{second_id}-checkpoint",
                                                "aliases": ["latest", "step4"], "metadata": {"step": 4}, "files": files}]
