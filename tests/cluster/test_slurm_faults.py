"""What SLURM and a cluster do to a run, on the local cluster through sbatch launch/slurm.sbatch, each ending on
the one-process run's curve (fp32, data parallelism across the two nodes):

- preemption as SLURM does it: a one-minute limit with --signal=USR1@40 reaches both ranks, they save and the
  script requeues the job, which resumes in the same run folder; then scancel: SIGTERM to every task ends the
  requeued run with a checkpoint, and the job is not requeued again;
- a link cut for a few seconds (shorter than train.peer_timeout_s), then restored: the run goes on, nothing
  restarted; then, in the same run, a node lost (its link down, then every process in it killed): the
  survivor notices within train.peer_timeout_s, the script starts it again on the node left, with
  parallel.layout=auto, from the newest checkpoint.
"""

from __future__ import annotations

import json
import time

import pytest
from cli import assert_same_losses, metrics
from cluster_runs import DONE_STATES, job, one_process, rows, submit, tiny, wait_job, wait_rows

ACROSS = ("--nodes=2", "--ntasks-per-node=1")


def test_slurm_time_limit_signal_requeues_and_resumes_then_scancel_ends_with_a_checkpoint(cluster, shared,
                                                                                         shared_corpus, tmp_path):
    """One job, both of SLURM's stops: the time limit's SIGUSR1 (checkpoint, requeue, resume in the same folder),
    then scancel's SIGTERM to the requeued job (checkpoint, CANCELLED, no requeue); its steps on the curve."""
    common = ("train.checkpoint_interval=0", "train.eval_interval=0")
    run_dir = shared / "run"
    job_id = submit(cluster, run_dir, tiny(shared_corpus, "train.max_steps=5000", *common),
                    (*ACROSS, "--time=1", "--signal=USR1@40"))
    out = run_dir.parent / "run.slurm.out"
    deadline, extended = time.monotonic() + 240, False
    while "resumed from" not in (text := out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline and job(cluster, job_id)["JobState"] not in DONE_STATES, text[-3000:]
        if not extended and "requeueing job" in text:
            # the requeued job would get the same minute and its own warning: ten, so that only scancel stops it
            cluster.slurm("scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
            extended = True
        time.sleep(0.5)
    stop = json.loads(text.split("stopped early (")[1].split(")")[0])
    assert stop["signal"] == "SIGUSR1" and stop["step"] > 0, text[-3000:]
    step = stop["step"]
    assert f"requeueing job {job_id}" in text
    assert f"resumed from {run_dir / 'checkpoints' / f'step{step:08d}'} at step {step}" in text
    wait_rows(run_dir, step + 3)
    assert not (run_dir / "preempted.json").exists()  # the resumed run cleared the marker it was requeued on
    cluster.slurm("scancel", str(job_id))
    ended = wait_job(cluster, job_id, out)
    assert ended.state == "CANCELLED" and ended.restarts == 1, ended.output[-3000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    assert marker["signal"] == "SIGTERM" and marker["step"] > step + 2
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step{marker['step']:08d}"
    time.sleep(2)
    assert job(cluster, job_id)["JobState"] == "CANCELLED"  # not pending again: no requeue
    got = metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, marker["step"] + 1))
    assert_same_losses(got, one_process(tmp_path / "one", shared_corpus, f"train.max_steps={marker['step']}",
                                        *common))


@pytest.fixture
def node2_back(cluster):
    yield
    if "node2/holder" not in cluster.pids:
        cluster.revive("node2")


def test_a_cut_link_is_ridden_out_then_a_lost_node_the_job_goes_on_by_itself_on_the_curve(cluster, shared,
                                                                                         shared_corpus, tmp_path,
                                                                                         node2_back):
    """One run: node2's link cut for 4 s (shorter than train.peer_timeout_s) stalls the steps and nothing more;
    later node2 dies, and the job goes on on node1 alone from the newest checkpoint."""
    steps, overrides = 40, ("train.checkpoint_interval=10", "parallel.layout=auto", "train.peer_timeout_s=6")
    run_dir = shared / "run"
    cluster.wait_idle()  # a node range starts on the nodes free at the time
    job_id = submit(cluster, run_dir, tiny(shared_corpus, f"train.max_steps={steps}", *overrides, auto=True),
                    ("--nodes=1-2",), env={"MAX_RESTARTS": "1"})
    wait_rows(run_dir, 5)
    cluster.cut_link("node2")
    cut = rows(run_dir)
    time.sleep(4)
    during = rows(run_dir) - cut  # the link really was cut: no step gets through it (one may be ending)
    cluster.restore_link("node2")
    assert during <= 1
    wait_rows(run_dir, 14)
    killed_at = rows(run_dir)
    cluster.kill_node("node2")
    ended = wait_job(cluster, job_id, f"{run_dir}.slurm.out", timeout=300, completing=True)
    assert ended.exit_code == 0 and ended.restarts == 0, ended.output[-3000:]
    assert ended.output.count("sent no heartbeat") == 1  # the cut went unreported; the death did not
    assert "rank 0: rank 1 (host node2) sent no heartbeat" in ended.output
    assert "starting again on 1 node(s) (node1), restart 1 of 1" in ended.output
    assert not list(run_dir.glob("lost-nodes*"))  # each start's report read and removed by the script
    resumed = int(ended.output.split("resumed from ")[1].split(" at step ")[1].split(" ")[0])
    assert resumed == killed_at // 10 * 10  # the newest checkpoint before the kill
    assert "now tp=1 pp=1 dp=1 zero=0" in ended.output
    reference = one_process(tmp_path / "one", shared_corpus, f"train.max_steps={steps}", *overrides, auto=True)
    assert_same_losses(metrics(run_dir), reference)
