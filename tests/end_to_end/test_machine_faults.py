"""Faults of the machine around a run, through `python -m train`: a disk that fills up at a save (in the
training thread and in the background), a run folder that turns read-only, a data file that is gone for
good or for a moment.

Each fault is injected into the run's process by tests/helpers/faults/sitecustomize.py, enabled by the
environment (tests/helpers/machine_faults.py): no root, no small disk, nothing in gpt3d's code. Each test
checks the run's one error line (no traceback), its exit code and the checkpoints it leaves (every step
folder intact, no temporary folder); where the fault allows, the run goes on from what it left exactly as
the uninterrupted run did (the same losses, bit for bit). The run that resumes after a full disk stands
for the read-only folder too: both leave the same thing behind, the newest checkpoint and nothing else.

Every run is the TINY model for 6 steps, documents cut into short pieces with one window per stream
shuffled at a time (data.piece_chars, data.shuffle_buffer), so that data files are opened at every few
steps, as a long run opens them.
"""

from __future__ import annotations

import json
import re

import pytest
from cli import metrics, train
from machine_faults import fault_env, injected

STEPS = 6
RUN = [f"train.max_steps={STEPS}", "train.checkpoint_interval=2", "train.eval_interval=0", "logging.wandb.mode=disabled",
       "data.piece_chars=120", "data.shuffle_buffer=4", "data.read_retries=2", "data.read_retry_s=0.01"]
COMPARED = ("step", "tokens", "train/loss", "train/lr", "train/grad_norm", "train/skipped_steps")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    """The run no fault meets."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    train(run_dir, corpus, *RUN)
    return run_dir


def checkpoint_bytes(run_dir) -> int:
    """A checkpoint's bytes as the planner counts them, for the model a run's final checkpoint holds."""
    from model import GPTConfig
    from train.planner.counts import checkpoint_bytes as planned

    state = json.loads((run_dir / f"checkpoints/step{STEPS:08d}/state.json").read_text())
    return planned(GPTConfig(**state["model"]))


def faulty(run_dir, corpus, *overrides, **faults):
    """The run with `faults` injected; the hook's log is <run dir>.faults."""
    env = fault_env(log=str(run_dir.with_suffix(".faults")), **faults)
    return train(run_dir, corpus, *RUN, *overrides, check=False, env=env)


def error_line(proc, code: int) -> str:
    """The run's one `gpt3d: error:` line, checked: exit code `code`, no traceback anywhere."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("gpt3d: error:")]
    return line


def checkpoints_left(run_dir) -> list[str]:
    """What checkpoints/ holds, each step folder verified intact (structure, checksums, content)."""
    from train.checkpoint.integrity import verify

    root = run_dir / "checkpoints"
    for folder in root.glob("step*"):
        problems, _ = verify(folder)
        assert problems == [], folder
    return sorted(p.name for p in root.iterdir())


def curve(run_dir) -> list[list]:
    return [[row.get(key) for key in COMPARED] for row in metrics(run_dir)]


def test_a_full_disk_stops_the_save_with_one_line_and_the_run_resumes_once_there_is_room(tmp_path, corpus, uninterrupted):
    from train.checkpoint.storage import size_text

    each = checkpoint_bytes(uninterrupted)
    shard = next((uninterrupted / f"checkpoints/step{STEPS:08d}").glob("*.safetensors")).stat().st_size
    assert each <= shard <= each + 64_000  # the planner's count is the tensors; the header adds a little
    run_dir = tmp_path / "run"
    proc = faulty(run_dir, corpus, disk={"root": str(tmp_path), "capacity": int(2.5 * each)})

    root = run_dir / "checkpoints"
    warning = f"gpt3d: warning: {root} has {size_text(int(2.5 * each))} free, less than the {size_text(4 * each)}"
    assert warning in proc.stderr  # pre-flight: keep_checkpoints=3, and one more while a save is written
    line = error_line(proc, 4)
    assert line.startswith(f"gpt3d: error: the checkpoint of step 6 does not fit in {root} (No space left on device): "
                           f"it needs {size_text(each)}, ")
    free = float(re.search(r", ([\d.]+) MB free;", line)[1]) * 1e6
    assert free < each
    assert line.endswith(f"the newest checkpoint, {root / 'step00000004'}, is kept; free space there, lower "
                         "train.keep_checkpoints (now 3), or move the run folder to a larger disk and resume there "
                         "(hydra.run.dir=<new folder>)")
    assert [name for name, _ in injected(run_dir.with_suffix(".faults"))] == ["ENOSPC"]
    assert checkpoints_left(run_dir) == ["latest", "step00000002", "step00000004"]
    assert (root / "latest").read_text().strip() == "step00000004"

    resumed = train(run_dir, corpus, *RUN)  # room again: the same command
    assert f"resumed from {root / 'step00000004'} at step 4" in resumed.stdout
    assert curve(run_dir) == curve(uninterrupted)


def test_a_background_save_that_fails_stops_the_run_at_the_next_step(tmp_path, corpus, uninterrupted):
    each = checkpoint_bytes(uninterrupted)
    run_dir = tmp_path / "run"
    proc = faulty(run_dir, corpus, "train.async_checkpoint=true", "train.max_steps=12", "train.checkpoint_interval=4",
                  disk={"root": str(tmp_path), "capacity": int(1.5 * each)})

    root = run_dir / "checkpoints"
    line = error_line(proc, 4)
    assert line.startswith(f"gpt3d: error: the checkpoint of step 8 does not fit in {root} (No space left on device)")
    assert f"the newest checkpoint, {root / 'step00000004'}, is kept" in line
    # step 8's write failed while the steps after it ran (how many depends on the writer thread's speed):
    # the run stops at the end of the step it failed in, before its next save (step 12) would wait for it
    assert 9 <= metrics(run_dir)[-1]["step"] < 12
    assert checkpoints_left(run_dir) == ["latest", "step00000004"]


def test_a_run_folder_turned_read_only_stops_the_save_never_the_metrics(tmp_path, corpus):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    proc = faulty(run_dir, corpus, read_only={"root": str(run_dir), "when": str(root / "latest")})

    line = error_line(proc, 4)
    assert line.startswith(f"gpt3d: error: the checkpoint of step 4 cannot be written in {root} (Read-only file system): ")
    assert line.endswith(f"the newest checkpoint, {root / 'step00000002'}, is kept; make {root} writable again, or move "
                         "the run folder to a writable disk and resume there (hydra.run.dir=<new folder>)")
    # metrics.jsonl turned unwritable after step 2's checkpoint: one warning, training went on to the save
    assert proc.stderr.count("gpt3d: warning: metrics.jsonl cannot be written (Read-only file system)") == 1
    assert "gpt3d: warning: writes that failed and were skipped: 2 to metrics.jsonl" in proc.stderr
    assert re.search(r"^step 4/6 \| loss", proc.stdout, re.M)
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    assert checkpoints_left(run_dir) == ["latest", "step00000002"]


def test_a_data_file_gone_for_good_saves_the_step_and_the_run_resumes_exactly_once_it_is_back(
        tmp_path, corpus, uninterrupted):
    run_dir = tmp_path / "run"
    gone = {"match": f"{corpus}/", "when": str(run_dir / "metrics.jsonl"), "lines": 3, "times": None}
    proc = faulty(run_dir, corpus, "train.checkpoint_interval=5", unreadable=gone)

    failed = injected(run_dir.with_suffix(".faults"))
    (file,) = {path for _, path in failed}
    assert [name for name, _ in failed] == ["ENOENT"] * 3  # the read, then its two retries
    assert proc.stderr.count(f"gpt3d: warning: data: {file} could not be read (No such file or directory); retry") == 2
    stopped = metrics(run_dir)[-1]["step"]
    saved = run_dir / f"checkpoints/step{stopped:08d}"
    assert error_line(proc, 5) == (
        f"gpt3d: error: data: {file} could not be read (No such file or directory), also after 2 retries; stopped "
        f"after step {stopped}, checkpoint {saved}; put the file back and re-run the same command: it resumes there")
    assert 3 <= stopped < 5  # a checkpoint no interval asked for: the one of the step the run stopped after
    assert checkpoints_left(run_dir) == ["latest", saved.name]

    resumed = train(run_dir, corpus, *RUN, "train.checkpoint_interval=5")  # the file is back
    assert f"resumed from {saved} at step {stopped}" in resumed.stdout
    assert curve(run_dir) == curve(uninterrupted)


def test_a_read_that_fails_twice_then_succeeds_leaves_the_loss_curve_as_it_was(tmp_path, corpus, uninterrupted):
    run_dir = tmp_path / "run"
    flicker = {"match": f"{corpus}/", "when": str(run_dir / "metrics.jsonl"), "lines": 3, "times": 2}
    proc = faulty(run_dir, corpus, unreadable=flicker)

    assert proc.returncode == 0, proc.stderr[-3000:]
    (file,) = {path for _, path in injected(run_dir.with_suffix(".faults"))}
    assert [line.split("; ")[-1] for line in proc.stderr.splitlines() if line.startswith(f"gpt3d: warning: data: {file}")
            ] == ["retry 1 of 2 in 0.01 s", "retry 2 of 2 in 0.02 s"]
    assert curve(run_dir) == curve(uninterrupted)
    assert metrics(run_dir)[-1]["data/read_retries"] == 2
