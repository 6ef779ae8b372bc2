"""torchrun and DeepSpeed's launcher across the two nodes of the local cluster, as a user runs them: the same
launch/torchrun.sh line on each node (static, then elastic with a node lost), launch/deepspeed.sh once on the
first node with a hostfile naming both (DeepSpeed's default multi-node runner: pdsh over ssh). Each run ends on
the one-process run's curve (fp32)."""

from __future__ import annotations

import subprocess

from cli import assert_same_losses, metrics
from cluster_runs import on_node, one_process, read, tiny, wait_rows

STEPS = 8


def wait_all(procs: list[subprocess.Popen], logs: list, timeout: float = 300) -> None:
    for proc, log in zip(procs, logs):
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{log} still running after {timeout} s:\n{read(log)[-3000:]}") from None
        assert code == 0, f"{log} exited {code}:\n{read(log)[-3000:]}"


def test_torchrun_static_two_nodes(cluster, shared, shared_corpus, tmp_path):
    run_dir = shared / "run"
    args = tiny(shared_corpus, f"train.max_steps={STEPS}")
    env = {"NNODES": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29510", "GPT3D_RUN_STAMP": "static",
           "RUN_DIR": str(run_dir)}
    logs = [shared / f"{node}.log" for node in cluster.nodes]
    procs = [on_node(cluster, node, ["launch/torchrun.sh", *args], log, {**env, "NODE_RANK": str(i)})
             for i, (node, log) in enumerate(zip(cluster.nodes, logs))]
    wait_all(procs, logs)
    assert "2 process(es) on cpu (tp=1 pp=1 dp=2 zero=0)" in read(logs[0])
    assert_same_losses(metrics(run_dir), one_process(tmp_path / "one", shared_corpus, f"train.max_steps={STEPS}"))


def test_torchrun_elastic_goes_on_with_one_node_when_the_other_is_lost(cluster, shared, shared_corpus, tmp_path):
    run_dir, steps = shared / "run", 40
    overrides = (f"train.max_steps={steps}", "train.checkpoint_interval=10", "parallel.layout=auto",
                 "train.peer_timeout_s=6")
    env = {"NNODES": "1:2", "MAX_RESTARTS": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29520",
           "GPT3D_RUN_STAMP": "elastic", "RUN_DIR": str(run_dir)}
    logs = [shared / f"{node}.log" for node in cluster.nodes]
    procs = [on_node(cluster, node, ["launch/torchrun.sh", *tiny(shared_corpus, *overrides, auto=True)], log, env)
             for node, log in zip(cluster.nodes, logs)]
    try:
        wait_rows(run_dir, 14)
        cluster.kill_node("node2")
        wait_all(procs[:1], logs[:1])
    finally:
        procs[1].kill()
        cluster.revive("node2")
    out = read(logs[0])
    assert "rank 0: rank 1 (host node2) sent no heartbeat" in out
    assert "resumed from" in out and "now tp=1 pp=1 dp=1 zero=0" in out
    reference = one_process(tmp_path / "one", shared_corpus, *overrides, auto=True)
    assert_same_losses(metrics(run_dir), reference)


def test_deepspeed_runner_over_ssh_on_both_nodes(cluster, shared, shared_corpus, tmp_path):
    run_dir = shared / "run"
    hostfile = shared / "hostfile"
    hostfile.write_text("".join(f"{node} slots=1\n" for node in cluster.nodes))
    log = shared / "deepspeed.log"
    proc = on_node(cluster, "node1", ["launch/deepspeed.sh", *tiny(shared_corpus, f"train.max_steps={STEPS}")], log,
                   {"HOSTFILE": str(hostfile), "RUN_DIR": str(run_dir), "GPT3D_RUN_STAMP": "ds"})
    wait_all([proc], [log])
    out = read(log)
    assert "node1: model toy" in out and "node2:" in out  # pdsh prefixes each node's lines
    assert "2 process(es) on cpu (tp=1 pp=1 dp=2 zero=0)" in out
    assert_same_losses(metrics(run_dir), one_process(tmp_path / "one", shared_corpus, f"train.max_steps={STEPS}"))
