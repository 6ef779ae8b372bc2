"""launch/torchrun.sh's elastic form across the two nodes of the local cluster (NNODES=1:2, MAX_RESTARTS=1): node2
lost mid-run, the agent on node1 starts its worker again alone (after a rendezvous last call of 3 s, RDZV_CONF), with parallel.layout=auto, and it resumes from the
newest checkpoint on the one-process run's curve (fp32)."""

from __future__ import annotations

from cli import assert_same_losses, metrics
from cluster_runs import on_node, one_process, read, tiny, wait_all, wait_rows


def test_torchrun_elastic_goes_on_with_one_node_when_the_other_is_lost(cluster, shared, shared_corpus, tmp_path):
    run_dir, steps = shared / "run", 40
    overrides = (f"train.max_steps={steps}", "train.checkpoint_interval=10", "parallel.layout=auto",
                 "train.peer_timeout_s=6")
    env = {"NNODES": "1:2", "MAX_RESTARTS": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29520",
           "GPT3D_RUN_STAMP": "elastic", "RUN_DIR": str(run_dir), "RDZV_CONF": "last_call_timeout=3"}
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
