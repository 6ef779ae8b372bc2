"""launch/torchrun.sh across the two nodes of the local cluster, as a user runs it: the same line on each node,
NNODES=2, NODE_RANK 0 and 1. The run ends on the one-process run's curve (fp32)."""

from __future__ import annotations

from cli import assert_same_losses, metrics
from cluster_runs import on_node, one_process, read, tiny, wait_all

STEPS = 8


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
