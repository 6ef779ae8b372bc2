"""Elastic restarts at parallel.layout=auto, with gloo processes on the CPU.

- A run on 8 processes is killed with SIGKILL (every process, as when its node dies) after its first
  checkpoint; copies of its run folder restart on 6 and on 4 processes (each run's ranks forked with the
  environment torchrun gives its workers, tests/helpers/warm.py; torchrun itself starts and restarts the next
  case's, and tests/cluster/test_torchrun_elastic.py's). Each restart takes the layout
  the CPU rule gives for its world size (worked out by hand below), says so in one line and in its
  first metrics record, and the whole run (8 processes up to the checkpoint, then 6 or 4) follows the
  one-process run of the same config: per-step losses within 1e-5 relative (float32).
- torchrun's own elastic restart (launch/torchrun.sh's elastic form): 2 workers with --max-restarts=1 and
  a c10d rendezvous, one worker killed with SIGKILL after the first checkpoint; torchrun restarts both,
  they find the same run folder (its name comes from the launch stamp, the agent's start time) and resume
  from its checkpoint, and the job ends by itself on the one-process loss curve; in bf16
  (train.precision=bf16, the GPU default; in fp32 across two nodes: tests/cluster/test_torchrun_elastic.py).

The CPU rule at train.global_batch_size=24 with data.streams=4 (dp and the streams must divide one
another) and 3 layers of 2 heads: 8 processes -> dp=8, micro batch 24/8 = 3; 6 processes -> dp=6 and
dp=3 are not allowed by 4 streams, so dp=2 with tp·pp=3, and tp=3 does not divide 2 heads: tp=1 pp=3,
micro batch 24/2 = 12; 4 processes -> dp=4, micro batch 6; 2 processes -> dp=2, micro batch 12.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli import (BIN, REPO, TINY, assert_same_losses, free_port, metrics, read_log, run_module, start, start_forked,
                 train)

STEPS = ["train.max_steps=4", "train.checkpoint_interval=2", "train.eval_interval=0", "logging.wandb.mode=disabled",
         "train.global_batch_size=24", "data.streams=4"]
AUTO = [o for o in TINY if not o.startswith(("train.micro_batch_size", "train.global_batch_size"))]
LAYOUT_LINE = re.compile(r"gpt3d: layout auto for (\d+) processes on cpu: tp=(\d+) pp=(\d+) dp=(\d+) zero=0 micro=(\d+) ")


def auto_arguments(run_dir, corpus) -> list[str]:
    return [f"hydra.run.dir={run_dir}", *AUTO, f"data.paths=[{corpus}/*.txt]", *STEPS, "parallel.layout=auto"]


def train_auto(run_dir: Path, corpus, nproc: int) -> subprocess.CompletedProcess:
    """`nproc` ranks of `python -m train` at parallel.layout=auto, forked as torchrun would start them."""
    proc = run_module("train", auto_arguments(run_dir, corpus), "ranks", nproc)
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus):
    """The reference: one process at the manual layout (micro batch 12), never interrupted."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train(run_dir, corpus, *STEPS, "train.micro_batch_size=12")
    return metrics(run_dir)


@pytest.fixture(scope="module")
def one_process_bf16(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("one_bf16") / "run"
    train(run_dir, corpus, *STEPS, "train.micro_batch_size=12", "train.precision=bf16")
    return metrics(run_dir)


def processes_of(agent: int) -> list[int]:
    """The pids whose parent is `agent` (torchrun's workers: each in a session of its own)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == agent:
            children.append(int(stat.parent.name))
    return children


def wait_for_checkpoint(proc, run_dir: Path, log: Path) -> None:
    latest, deadline = run_dir / "checkpoints" / "latest", time.monotonic() + 300
    while not latest.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert latest.is_file(), read_log(log)


@pytest.fixture(scope="module")
def killed_at_eight(tmp_path_factory, corpus):
    """8 processes at parallel.layout=auto, all killed with SIGKILL once the first checkpoint is published."""
    root = tmp_path_factory.mktemp("eight")
    run_dir, log = root / "run", root / "log"
    procs = start_forked("train", auto_arguments(run_dir, corpus), f"{log}.out", f"{log}.err", ranks=8)
    wait_for_checkpoint(procs, run_dir, log)
    procs.kill()
    procs.wait_codes()  # gone, not only signalled
    out, _ = read_log(log)
    assert LAYOUT_LINE.search(out).groups() == ("8", "1", "1", "8", "3")
    return run_dir


@pytest.mark.parametrize("nproc, layout", [(6, (1, 3, 2, 12)), (4, (1, 1, 4, 6))], ids=["6", "4"])
def test_killed_auto_run_resumes_on_fewer_processes_on_the_same_loss_curve(tmp_path, corpus, one_process,
                                                                           killed_at_eight, nproc, layout):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_at_eight, run_dir)
    proc = train_auto(run_dir, corpus, nproc)
    tp, pp, dp, micro = layout
    assert LAYOUT_LINE.search(proc.stdout).groups() == tuple(str(n) for n in (nproc, tp, pp, dp, micro))
    assert "resumed from" in proc.stdout and "(saved at tp=1 pp=1 dp=8 zero=0" in proc.stdout
    records = metrics(run_dir)
    assert_same_losses(records, one_process)
    first, restart = records[0], records[2]  # step 1 (the 8-process start), step 3 (this start)
    assert (first["layout/tp"], first["layout/pp"], first["layout/dp"], first["layout/micro_batch"]) == (1, 1, 8, 3)
    assert (restart["layout/tp"], restart["layout/pp"], restart["layout/dp"], restart["layout/micro_batch"]) == layout
    assert restart["layout/auto"].startswith(f"layout auto for {nproc} processes on cpu")
    assert "layout/tp" not in records[1] and "layout/tp" not in records[3]


def test_torchrun_elastic_restart_after_a_killed_worker_finishes_the_run_in_bf16(tmp_path, corpus, one_process_bf16):
    """(In fp32, across two nodes: tests/cluster/test_torchrun_elastic.py.)"""
    runs, log = tmp_path / "runs", tmp_path / "log"
    # the run folder named by the launch stamp, as by default: restarted workers must find the same one
    arguments = [*auto_arguments(runs, corpus), "train.precision=bf16"]
    arguments[0] = f"hydra.run.dir={runs}/${{launch_stamp:}}"
    port = free_port()
    # launch/torchrun.sh's elastic form: torchrun --nproc_per_node 2 --max-restarts 1 --rdzv-backend c10d
    # --rdzv-endpoint 127.0.0.1:PORT -m train ...
    env = {"NPROC_PER_NODE": "2", "MAX_RESTARTS": "1", "MASTER_PORT": str(port), "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = start(log, ["bash", str(REPO / "launch" / "torchrun.sh"), *arguments], env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list(runs.glob("*/checkpoints/latest")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None and list(runs.glob("*/checkpoints/latest")), read_log(log)
    os.kill(max(processes_of(proc.pid)), signal.SIGKILL)  # one worker of the two
    assert proc.wait(timeout=300) == 0, read_log(log)
    out, err = read_log(log)
    assert [p.name for p in runs.iterdir()] == [next(runs.iterdir()).name]  # one run folder for both attempts
    run_dir = next(runs.iterdir())
    assert out.count("gpt3d: layout auto for 2 processes on cpu: tp=1 pp=1 dp=2 zero=0 micro=12 ") == 2
    assert "resumed from" in out, out + err
    assert_same_losses(metrics(run_dir), one_process_bf16, "bf16")
