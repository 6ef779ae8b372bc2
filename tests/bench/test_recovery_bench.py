"""`python -m bench.recovery` on the CPU, its kill and SIGTERM checks, through the real command: the
records it writes pass, and what they claim holds in the runs' own files, re-read here."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from cli import REPO, clean_env, metrics


def test_kill_and_sigterm_checks_pass_and_their_runs_agree_with_the_uninterrupted_one(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "recovery.json"
    cmd = [sys.executable, "-m", "bench.recovery", "--device", "cpu", "--checks", "kill,sigterm",
           "--run-dir", str(runs), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["check"]: r for r in json.loads(out.read_text())}
    assert list(records) == ["kill", "sigterm"]
    assert all(r["ok"] and r["device"] == "cpu" and r["commit"] for r in records.values())
    assert proc.stdout.count("PASS ") == 2 and "FAIL" not in proc.stdout

    straight = metrics(runs / "straight")
    steps = len(straight)
    assert [r["step"] for r in straight] == list(range(1, steps + 1))
    losses = [r["train/loss"] for r in straight]
    assert all(math.isfinite(x) for x in losses) and len(set(losses)) == steps  # a curve, not a constant

    kill = records["kill"]["numbers"]
    assert kill["killed_exit"] == -9 and kill["max_rel_diff"] == 0.0
    # killed after its first checkpoint and before its end, resumed from that checkpoint
    assert 1 <= kill["resumed_from_step"] <= kill["steps_logged_at_kill"] < kill["max_steps"] == steps
    assert f"resumed from {runs / 'killed' / 'checkpoints'}/step{kill['resumed_from_step']:08d}" in (
        runs / "killed.log").read_text()
    killed = metrics(runs / "killed")
    assert [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in killed] == [
        (r["step"], r["train/loss"], r["train/grad_norm"]) for r in straight]  # bit for bit

    term = records["sigterm"]["numbers"]
    stop = term["marker_step"]
    assert term["stopped_exit"] == 0 and term["marker_signal"] == "SIGTERM" and 3 <= stop < steps
    assert term["checkpoint_step"] == term["last_logged_step"] == stop and term["max_rel_diff_vs_straight"] == 0.0
    log = (runs / "sigterm.log").read_text()
    assert f"stopped after step {stop}, checkpoint {runs / 'sigterm' / 'checkpoints'}/step{stop:08d}" in log
    assert not (runs / "sigterm" / "preempted.json").exists()
    assert [r["train/loss"] for r in metrics(runs / "sigterm")] == losses
