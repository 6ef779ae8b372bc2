"""What sbatch and the launchers do with what a user gives them, on the local cluster:

- a refused setting: every rank on both nodes ends, one line from rank 0, exit code 2, no restart or requeue;
- multi-node torchrun without GPT3D_RUN_STAMP: one line, before anything starts;
- node ranges: with launch/slurm.sbatch's whole-node request, --nodes=1-2 gets both idle nodes; with
  --ntasks-per-node it gets one; a requeued job asks for the count it had (what the script's comments say).
"""

from __future__ import annotations

import subprocess
import time

from cli import REPO
from cluster_runs import job, job_env, on_node, read, submit, tiny, wait_job


def test_a_refused_setting_ends_both_nodes_with_one_line_and_exit_2(cluster, shared, shared_corpus):
    run_dir = shared / "run"
    job_id = submit(cluster, run_dir, tiny(shared_corpus, "parallel.tp=3"), ("--nodes=2", "--ntasks-per-node=1"),
                    env={"MAX_RESTARTS": "2"})
    ended = wait_job(cluster, job_id, f"{run_dir}.slurm.out")
    assert (ended.state, ended.exit_code, ended.restarts) == ("FAILED", 2, 0), ended.output[-3000:]
    errors = [line for line in ended.output.splitlines() if line.startswith("gpt3d: error:")]
    assert len(errors) == 1 and "parallel.tp" in errors[0], ended.output[-3000:]
    assert "starting again" not in ended.output and "requeueing" not in ended.output
    assert not (run_dir / "checkpoints").exists()


def test_multinode_torchrun_without_a_run_stamp_is_one_line(cluster, shared):
    log = shared / "torchrun.log"
    proc = on_node(cluster, "node1", ["launch/torchrun.sh", "train.max_steps=1"], log,
                   {"NNODES": "2", "MASTER_ADDR": "node1"})
    assert proc.wait(timeout=60) != 0
    lines = read(log).strip().splitlines()
    assert len(lines) == 1 and "set GPT3D_RUN_STAMP to the same value on every node" in lines[0], lines


def nodes_given(cluster, shared, *options: str) -> int:
    """How many nodes a job of launch/slurm.sbatch is given with `options`, both nodes idle (its ranks only
    print train's help)."""
    job_id = submit(cluster, shared / "help", ["--help"], options)
    ended = wait_job(cluster, job_id, f"{shared / 'help'}.slurm.out", timeout=120)
    assert ended.exit_code == 0, ended.output[-2000:]
    return int(job(cluster, job_id)["NumNodes"])


def test_a_node_range_gets_every_free_node_without_ntasks_per_node_and_the_minimum_with_it(cluster, shared):
    cluster.wait_idle()
    assert nodes_given(cluster, shared, "--nodes=1-2") == 2
    assert nodes_given(cluster, shared, "--nodes=1-2", "--ntasks-per-node=1") == 1


def test_a_requeued_job_asks_for_the_node_count_it_had_not_its_range(cluster):
    cluster.wait_idle()
    cmd = ["sbatch", "--parsable", "--exclusive", "--nodes=1-2", "--output=/dev/null", "--wrap=sleep 60"]
    job_id = int(subprocess.run(cmd, cwd=REPO, env=job_env(cluster), capture_output=True, text=True,
                                check=True).stdout.strip())
    try:
        deadline = time.monotonic() + 30
        while job(cluster, job_id)["JobState"] != "RUNNING":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert job(cluster, job_id)["NumNodes"] == "2"
        cluster.slurm("scontrol", "requeue", str(job_id))
        deadline = time.monotonic() + 30
        while (fields := job(cluster, job_id))["JobState"] != "PENDING":
            assert time.monotonic() < deadline, fields
            time.sleep(0.2)
        assert fields["NumNodes"] == "2" and fields["Restarts"] == "1", fields  # not 1-2
    finally:
        cluster.slurm("scancel", str(job_id))
