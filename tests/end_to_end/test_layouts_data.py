"""The layout promise with the rest of GPT-3's recipe, through the real launchers (gloo on the CPU):
background data workers, a weighted mixture and the batch-size ramp each reproduce their own
one-process losses at other layouts; a run resumed at dp=2 from a dp=4 checkpoint continues with the
same batches; and a run with all three, killed with SIGKILL, resumes bit for bit.

Each layout run is compared with the one-process run of the same config, as in test_layouts.py (loss
within 1e-5 relative, float32); the one-process references are module fixtures, shared.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pytest
from cli import assert_same_losses, kill_after_first_checkpoint, metrics, start_train, train
from test_layouts import STEPS, corpus, one_process  # noqa: F401 (fixtures: the same runs)

SEQ = 32  # TINY's model.seq_len
# Batches of 2, 4, 8 sequences: from 2 to 8 in increments of 2, one every 192 / 3 = 64 tokens (2 sequences).
RAMP = ["train.global_batch_size=8", "data.streams=2", "train.batch_ramp.start=2", "train.batch_ramp.tokens=192"]


def mixture(corpus: Path) -> list[str]:
    """Two sources of the test corpus, weighted 3 : 1: the logging module's functions, and the rest."""
    rest = ", ".join(f"{corpus}/{module}.*.txt" for module in ("argparse", "json", "pathlib", "string", "textwrap"))
    return ["data=mixture", "data.streams=2", "data.shuffle_buffer=64",
            f"data.sources=[{{label: logging, weight: 3, source: files, paths: [{corpus}/logging.*.txt]}}, "
            f"{{label: rest, weight: 1, source: files, paths: [{rest}]}}]"]


def assert_data_wait_logged(rows: list[dict]) -> None:
    assert rows and all(r["perf/data_wait_s"] >= 0 for r in rows)


# -- the batch-size ramp ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ramp_one_process(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("ramp")
    train(run_dir, corpus, *STEPS, *RAMP)
    return metrics(run_dir)


def test_ramp_batches_tokens_and_learning_rate_follow_the_tokens_seen(ramp_one_process):
    """One process: B(τ) = min(8, 2 + 2·⌊3τ/192⌋) sequences; the LR at the tokens seen after each step, by
    the warmup (32 tokens) + cosine (to 2,000 tokens) formula; the throughput counts the ramped batches."""
    rows, tokens, sizes, lrs = ramp_one_process, 0, [], []
    for _ in rows:
        sizes.append(min(8, 2 + 2 * (3 * tokens // 192)))
        tokens += sizes[-1] * SEQ
        lrs.append(3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (tokens - 32) / 1968))))
    assert sizes == [2, 4, 8]
    assert [r["train/batch_size"] for r in rows] == sizes
    assert [r["tokens"] for r in rows] == [SEQ * sum(sizes[: k + 1]) for k in range(3)]
    assert [r["train/lr"] for r in rows] == pytest.approx(lrs, rel=1e-9)
    assert_data_wait_logged(rows)


@pytest.mark.parametrize(
    "nproc, layout",
    [(2, ["parallel.zero_stage=2"]), (4, ["parallel.pp=2"])],
    ids=["zero2-dp2", "pp2-dp2"],
)
def test_ramp_at_a_layout_matches_one_process(tmp_path, corpus, ramp_one_process, nproc, layout):
    """DeepSpeed's gradient accumulation (1, 2, 4 micro batches per rank) and the pipeline's
    micro-batch count follow the batch."""
    train(tmp_path, corpus, *STEPS, *RAMP, *layout, kind="ranks", nproc=nproc)
    rows = metrics(tmp_path)
    assert_same_losses(rows, ramp_one_process)
    assert [r["train/batch_size"] for r in rows] == [r["train/batch_size"] for r in ramp_one_process]


def test_a_ramp_that_does_not_split_over_the_ranks_is_refused_early(tmp_path, corpus):
    """At dp=2 with micro batches of 2 a batch must be a multiple of lcm(2 streams, 2 × 2) = 4 sequences."""
    run_dir = tmp_path / "bad"
    proc = train(run_dir, corpus, *STEPS, *RAMP, "train.micro_batch_size=2", check=False,
                 env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.batch_ramp.start=2 sequences (2 sequences) is not a multiple of 4 sequences" in proc.stderr
    assert "start values that fit: [4] sequences" in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()


# -- background workers, a mixture ------------------------------------------------------------------------

def test_background_workers_at_zero3_dp2_match_one_process(tmp_path, corpus, one_process):
    """The workers pack the same batches: the reference is test_layouts.py's one-process run (no workers)."""
    train(tmp_path, corpus, *STEPS, "data.workers=1", "parallel.zero_stage=3", kind="ranks", nproc=2)
    rows = metrics(tmp_path)
    assert_same_losses(rows, one_process)
    assert_data_wait_logged(rows)
    assert_data_wait_logged(one_process)


@pytest.fixture(scope="module")
def mixture_one_process(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("mixture")
    train(run_dir, None, *STEPS, *mixture(corpus))
    return metrics(run_dir)


def test_a_mixture_logs_each_sources_share(mixture_one_process):
    """data/share/<label>: the share of all windows served so far, 4 per step over 2 streams."""
    for r in mixture_one_process:
        shares = {k: v for k, v in r.items() if k.startswith("data/share/")}
        assert set(shares) == {"data/share/logging", "data/share/rest"}
        assert sum(shares.values()) == pytest.approx(1.0)
        assert all(round(v * 4 * r["step"]) == pytest.approx(v * 4 * r["step"]) for v in shares.values())
    assert_data_wait_logged(mixture_one_process)


def test_mixture_at_zero1_dp2_matches_one_process(tmp_path, corpus, mixture_one_process):
    train(tmp_path, None, *STEPS, *mixture(corpus), "parallel.zero_stage=1", kind="ranks", nproc=2)
    rows = metrics(tmp_path)
    assert_same_losses(rows, mixture_one_process)
    assert [{k: v for k, v in r.items() if k.startswith("data/")} for r in rows] == \
        [{k: v for k, v in r.items() if k.startswith("data/")} for r in mixture_one_process]


# -- resume on another number of ranks; kill -9 -----------------------------------------------------------

def test_resumed_at_dp2_from_a_dp4_checkpoint_continues_with_the_same_batches(tmp_path, corpus, one_process):
    """4 ranks (one stream each) save after step 2; 2 ranks (two streams each) resume there and train step 3.
    Both follow the one-process losses, so step 3 trained on the same global batch."""
    dp4, dp2 = tmp_path / "dp4", tmp_path / "dp2"
    train(dp4, corpus, *STEPS, "train.checkpoint_interval=2", kind="ranks", nproc=4)
    assert_same_losses(metrics(dp4), one_process)
    proc = train(dp2, corpus, *STEPS, f"train.resume={dp4}/checkpoints/step00000002", kind="ranks", nproc=2)
    assert "resumed from" in proc.stdout and "dp=2" in proc.stdout
    rows = metrics(dp2)
    assert [r["step"] for r in rows] == [3]
    assert_same_losses(rows, one_process[2:])


def _session_processes(sid: int) -> list[int]:
    """Processes of session `sid` that are still running (zombies excluded)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def test_killed_run_with_workers_a_mixture_and_the_ramp_resumes_bit_for_bit(tmp_path, corpus):
    """SIGKILL (no chance to clean up) after the first checkpoint; the resumed run's steps equal the
    uninterrupted run's exactly: losses, gradient norms, learning rates, batch sizes, mixture shares.
    The killed run's background workers stop by themselves."""
    common = [*STEPS, *mixture(corpus), *RAMP, "data.workers=2"]  # 2 sources × 2 streams: 2 lanes a worker
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train(straight, None, *common, "train.max_steps=8")
    proc = start_train(killed, None, *common, "train.max_steps=100000", "train.checkpoint_interval=2", log=tmp_path / "log")
    try:
        resumed_from = kill_after_first_checkpoint(proc, killed, tmp_path / "log")
        deadline = time.monotonic() + 30
        while _session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _session_processes(proc.pid), "the killed run's data workers are still running"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the killed run is left
        except ProcessLookupError:
            pass
    assert 2 <= resumed_from < 8
    out = train(killed, None, *common, "train.max_steps=8")
    assert f"resumed from {killed / 'checkpoints' / f'step{resumed_from:08d}'} at step {resumed_from}" in out.stdout
    keys = ["step", "tokens", "train/loss", "train/grad_norm", "train/lr", "train/batch_size", "data/share/logging",
            "data/share/rest"]
    expected = [[r[k] for k in keys] for r in metrics(straight)]
    assert [r[5] for r in expected] == [2, 4, 8, 8, 8, 8, 8, 8]
    assert [[r[k] for k in keys] for r in metrics(killed)] == expected  # exact: the same floats
