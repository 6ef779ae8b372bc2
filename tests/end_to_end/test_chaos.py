"""Killed at random moments, resumed each time, a run ends bit for bit where an uninterrupted one ends.

A 2-process gloo run (dp=2, one `python -m train` per rank with a launcher's environment, forked by the warm
interpreter of tests/helpers/warm.py: its imports are done, the run's own start is not) with a checkpoint
(written in the background: train.async_checkpoint=true) and a metrics row every step is killed
(SIGKILL, both ranks at once, as a lost node would be) at a random moment: sometimes while it starts
or resumes, otherwise somewhere in the steps after its first new one (forward, backward, update,
logging, evaluation, checkpoint staging and background writes). It is started again with the same
command until it finishes. Then its final checkpoint (every file: weights, Adam state, LR schedule,
data position, RNG, counters) and every metrics row (step, tokens, losses, lr, gradient norm, skipped
steps) must equal those of the same run never interrupted, exactly, with no row lost or repeated.

GPT3D_CHAOS_KILLS sets the number of kills (4 by default; the slow mode is 20), GPT3D_CHAOS_SEED the
random moments.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from checkpoint_state import differences, load_folder
from cli import arguments, metrics, read_log, start_forked, write_corpus

KILLS = int(os.environ.get("GPT3D_CHAOS_KILLS", "4"))
SEED = int(os.environ.get("GPT3D_CHAOS_SEED", "0"))
STEPS = 3 * KILLS + 6
RUN = [f"train.max_steps={STEPS}", "train.checkpoint_interval=1", "train.eval_interval=5",
       "logging.wandb.mode=disabled", "train.async_checkpoint=true"]
COMPARED = ("step", "tokens", "train/loss", "train/lr", "train/grad_norm", "train/skipped_steps", "val/loss")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def start_ranks(run_dir, corpus, log):
    """Both ranks of one attempt, each its own process (its output in <log>-rank<r>.out and .err)."""
    return start_forked("train", arguments(run_dir, corpus, *RUN), f"{log}-rank{{rank}}.out", f"{log}-rank{{rank}}.err",
                        ranks=2)


def rows_logged(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def attempt(run_dir, corpus, log, rng: random.Random | None, timing: dict) -> str:
    """Start the run and, with an rng, kill it at a random moment; returns what happened.

    timing: seconds from start to the first new step ("startup") and per step ("step"), as measured by
    the attempts before, to place the moments."""
    procs = start_ranks(run_dir, corpus, log)
    started, rows_before = time.monotonic(), rows_logged(run_dir)
    kill_at = first = None
    if rng is not None and "startup" in timing and rng.random() < 0.25:  # now and then while it starts or resumes
        kill_at = started + rng.uniform(0.2, timing["startup"])
    try:
        while all(code is None for code in procs.codes()):
            now, rows = time.monotonic(), rows_logged(run_dir)
            if first is None and rows > rows_before:
                first = (now, rows)
                timing["startup"] = now - started
                if rng is not None and kill_at is None:  # otherwise within about two more steps
                    kill_at = now + rng.uniform(0, 2 * timing.get("step", 0.5))
            if kill_at is not None and now >= kill_at:
                procs.kill()
                if first is not None and rows > first[1]:
                    timing["step"] = (now - first[0]) / (rows - first[1])
                return f"killed {now - started:.2f} s after start, {rows - rows_before} new rows"
            time.sleep(0.01)
        codes = procs.wait_codes()
        assert codes == [0, 0], f"attempt ended with {codes}:\n" + "\n".join(
            read_log(f"{log}-rank{r}")[1][-3000:] for r in range(2))
        return "finished"
    finally:
        procs.kill()
        procs.wait_codes()


def test_random_kills_resume_to_the_uninterrupted_run_bit_for_bit(tmp_path, corpus):
    straight, chaos = tmp_path / "straight", tmp_path / "chaos"
    procs = start_ranks(straight, corpus, tmp_path / "straight")
    assert procs.wait_codes(timeout=900) == [0, 0], read_log(tmp_path / "straight-rank0")[1][-3000:]

    rng, timing, history = random.Random(SEED), {}, []
    while sum(h.startswith("killed") for h in history) < KILLS:
        history.append(attempt(chaos, corpus, tmp_path / f"attempt{len(history)}", rng, timing))
        assert history[-1] != "finished", f"the run finished before {KILLS} kills: {history}"
    history.append(attempt(chaos, corpus, tmp_path / "last", None, timing))
    assert history[-1] == "finished", history

    expected = [[r.get(k) for k in COMPARED] for r in metrics(straight)]
    got = [[r.get(k) for k in COMPARED] for r in metrics(chaos)]
    assert [r[0] for r in got] == list(range(1, STEPS + 1)), history  # every step once, in order
    assert got == expected, history
    final = f"checkpoints/step{STEPS:08d}"
    a, b = load_folder(straight / final), load_folder(chaos / final)
    assert sorted(a) == sorted(b)
    for state in (a, b):  # Python's `random`, which training never seeds nor uses: each process starts its own
        for rank in state["rng.json"]["ranks"]:
            del rank["python"]
    assert [d for name in a for d in differences(a[name], b[name], name, top=False)] == [], history
