"""launch/deepspeed.sh once on the first node of the local cluster with a hostfile naming both (DeepSpeed's default
multi-node runner: pdsh over ssh). The run ends on the one-process run's curve (fp32)."""

from __future__ import annotations

from cli import assert_same_losses, metrics
from cluster_runs import on_node, one_process, read, tiny, wait_all

STEPS = 8


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
