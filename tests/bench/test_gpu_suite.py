"""bench/gpu_suite.sh on a CPU: its section list, the selection of sections, bad input, the results file
that each job appends to and the scratch folder. A stand-in for Python answers the suite's CUDA probes
and records the commands of the sections instead of running them."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ["cuda-tests", "train-small", "step-65k", "profile", "train-large", "recovery-exact", "recovery-paths",
            "fp8-products", "shard", "fp8-large", "attention", "attention-sweep", "attention-band"]
MODULE = {"cuda-tests": "pytest", "attention": "bench.attention", "train-small": "bench.train_speed",
          "step-65k": "bench.train_speed", "profile": "bench.profile", "train-large": "bench.train_speed",
          "shard": "bench.shard", "recovery-exact": "bench.recovery", "recovery-paths": "bench.recovery",
          "fp8-products": "bench.fp8_products", "fp8-large": "bench.train_speed",
          "attention-sweep": "bench.attention_sweep", "attention-band": "bench.attention"}
JOB_LIMIT_S = 540  # a 10-minute job, less a minute for starting and for the header
STUB = r"""#!/usr/bin/env bash
# Python on a CUDA machine, as the suite sees it: the probes answer, every other command is recorded.
set -euo pipefail
case "$1" in
  -c) case "$2" in *get_device_name*) echo "Stub-GPU" ;; esac; exit 0 ;;
  -) cat > /dev/null; echo "python stub"; exit 0 ;;
esac
echo "$*" >> "$STUB_LOG"
echo "stub ran: $*"
mkdir -p "$TMPDIR/run/checkpoints"  # what a benchmark leaves in its scratch folder
touch "$TMPDIR/run/checkpoints/model.safetensors" "$TMPDIR/run/trace.json"
if [ -n "${STUB_FAIL:-}" ] && [[ "$*" == *"$STUB_FAIL"* ]]; then exit 3; fi
"""


@pytest.fixture
def suite(tmp_path):
    """Runs the suite with the stand-in Python; returns (process, results folder, scratch, log of commands)."""
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out, scratch, log = tmp_path / "results", tmp_path / "scratch", tmp_path / "commands.log"

    def run(*args, python=str(stub), **env):
        environ = {**os.environ, "PYTHON": python, "SUITE_SCRATCH": str(scratch), "STUB_LOG": str(log), **env}
        proc = subprocess.run(["bash", "bench/gpu_suite.sh", str(out), *args], cwd=REPO, env=environ,
                              capture_output=True, text=True, timeout=120)
        commands = log.read_text().splitlines() if log.exists() else []
        return proc, out, scratch, commands

    return run


def today_file(out: Path) -> Path:
    return out / f"Stub-GPU-{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}.md"


def test_list_prints_every_section_with_its_limit_in_six_jobs_that_fit_ten_minutes(suite):
    proc, _, _, commands = suite("--list")
    assert proc.returncode == 0 and not commands, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:] if re.match(r"^[a-z0-9-]+ +\d+ s ", line)]
    assert [r[0] for r in rows] == SECTIONS
    limits = {r[0]: int(r[1]) for r in rows}
    jobs = {r[0]: int(r[3]) for r in rows}
    assert all(limit <= 480 for limit in limits.values())  # each section well inside 9 minutes
    job_lines = [line for line in proc.stdout.splitlines() if line.startswith("job ")]
    assert len(job_lines) == 6
    listed = []
    for number, line in enumerate(job_lines, 1):
        total, names = re.fullmatch(r"job \d: (\d+) s of limits: bash bench/gpu_suite.sh --only (\S+)", line).groups()
        names = names.split(",")
        assert all(jobs[n] == number for n in names)
        assert int(total) == sum(limits[n] for n in names) <= JOB_LIMIT_S
        listed += names
    assert listed == SECTIONS  # the jobs, in order, are the whole suite
    assert jobs["cuda-tests"] == jobs["train-small"] == jobs["step-65k"] == jobs["profile"] == 1  # the headline


@pytest.mark.parametrize("args, bad", [(["--only", "attention,bogus"], "unknown section 'bogus'"),
                                       (["--only", ""], "no section named"),
                                       (["--only"], "--only takes section names"),
                                       (["--bogus"], "unknown option '--bogus'")])
def test_bad_input_is_one_line_naming_it_and_exit_2_before_anything_runs(suite, args, bad):
    proc, out, _, commands = suite(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and bad in proc.stderr, proc.stderr
    if "section" in bad:
        assert ", ".join(SECTIONS) in proc.stderr  # the valid names
    assert not commands and not out.exists()


def test_only_runs_the_named_sections_and_a_later_job_appends_to_the_days_file(suite):
    proc, out, scratch, commands = suite("--only", "profile,attention")
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[1] for c in commands] == ["bench.profile", "bench.attention"]  # in the order given
    result = today_file(out)
    text = result.read_text()
    assert re.findall(r"^### ([a-z0-9-]+):", text, re.M) == ["profile", "attention"]
    assert f"--json {str(result)[:-3]}-attention.json" in commands[1]
    assert f"--json {str(result)[:-3]}-profile.json" in commands[0]
    run_dir = commands[0].split("--run-dir ")[1].split()[0]
    assert run_dir.startswith(f"{scratch}/") and run_dir.endswith("-profile/run")  # the trace stays out of results
    assert text.count("exit code 0") == 2 and "stub ran: -m bench.attention" in text
    # each section's scratch folder keeps its trace, not its checkpoints
    folders = sorted(p for p in scratch.iterdir() if p.is_dir())
    assert [f.name.split("-", 2)[2] for f in folders] == ["attention", "profile"]
    for folder in folders:
        assert (folder / "run" / "trace.json").exists() and not (folder / "run" / "checkpoints").exists()

    proc, _, _, commands = suite("--only", "shard,shard")
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[1] for c in commands[2:]] == ["bench.shard", "bench.shard"]  # one section, two models
    text = result.read_text()
    assert text.count("# gpt3d GPU suite on Stub-GPU") == 1
    assert re.findall(r"^## Job at \d\d:\d\d UTC: (\S+)", text, re.M) == ["profile,attention", "shard"]
    assert re.findall(r"^### ([a-z0-9-]+):", text, re.M) == ["profile", "attention", "shard"]
    assert sorted(p.name for p in out.iterdir()) == [result.name]  # the stand-in wrote no JSON


def test_a_failing_section_is_recorded_and_the_next_one_still_runs(suite):
    proc, out, _, commands = suite("--only", "attention,train-small", STUB_FAIL="bench.attention")
    assert proc.returncode == 1
    assert [c.split()[1] for c in commands] == ["bench.attention", "bench.train_speed"]
    text = today_file(out).read_text()
    attention, train = text.split("### train-small:")
    assert "FAILED: exit code 3" in attention and "exit code 0" in train and "FAILED" not in train


def test_sections_the_deadline_leaves_no_time_for_are_skipped(suite):
    proc, out, _, commands = suite("--only", "cuda-tests,attention", SUITE_SECONDS="10")
    assert proc.returncode == 1 and not commands
    assert today_file(out).read_text().count("SKIPPED: the deadline (SUITE_SECONDS=10) leaves") == 2


def test_dry_run_prints_the_selected_commands_and_runs_nothing(suite):
    proc, out, _, commands = suite("--only", "train-large,recovery-exact", "--dry-run")
    assert proc.returncode == 0 and not commands and not out.exists()
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["train-large", "recovery-exact"]
    assert "(420 s):" in lines[0] and "model=gpt3-760m model=gpt3-1.3b" in lines[0]
    assert "--checks kill,sigterm" in lines[1]


def test_the_float8_job_writes_the_product_table_then_times_the_blocks_and_the_pair_by_it(suite):
    """Job 4: the sweep first (inside its section's limit), so the shard and the 1.3B pair choose their float8
    linears by the table it writes; both put bf16 beside fp8."""
    proc, _, _, commands = suite("--only", "fp8-products,shard,fp8-large", "--dry-run")
    assert proc.returncode == 0 and not commands
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["fp8-products", "shard", "fp8-large"]
    assert "(120 s):" in lines[0] and "-m bench.fp8_products --budget-s 95" in lines[0]
    assert lines[1].count("train.precision=fp8") == 2 and "model=gpt3-175b parallel.tp=8" in lines[1]
    assert "model=gpt3-1.3b --fp8-pair" in lines[2]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_the_suite_exits_2_with_one_line(suite):
    proc, out, _, _ = suite("--only", "attention", python=sys.executable)
    assert proc.returncode == 2 and proc.stdout == "" and not out.exists()
    assert proc.stderr == f"gpu_suite: no CUDA device visible to {sys.executable}; nothing to measure\n"
