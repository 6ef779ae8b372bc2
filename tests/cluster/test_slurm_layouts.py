"""sbatch launch/slurm.sbatch on two nodes of the local cluster: the ranks of one run on two hosts talk over the
cluster's link, and each layout ends on the one-process run's curve (fp32 1e-5; bf16 like the other layouts). (Data
parallelism across the nodes, one task a node, is what test_slurm_faults.py's runs do, each on the curve.)

- pp=2, one stage a node: the activations and their gradients cross the link (bf16);
- tp=2 inside a node x dp=2 across the nodes (fp32), two tasks a node.

Each run writes one run folder in the shared folder: one metrics file, one W&B run (offline), the checkpoint's
parts from the ranks of both nodes, and nothing of the run on either node's local disk."""

from __future__ import annotations

import json

import pytest
from cli import assert_same_losses, metrics
from cluster_runs import node_local_files, one_process, submit, tiny, wait_job

STEPS = 6
LAYOUTS = {  # name: (overrides, sbatch options, precision)
    "pp-across": (["parallel.pp=2"], ("--nodes=2", "--ntasks-per-node=1"), "bf16"),
    "tp-in-dp-across": (["parallel.tp=2"], ("--nodes=2", "--ntasks-per-node=2"), "fp32"),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory, shared_corpus):
    """The one-process run of each precision (the reference every layout must follow)."""
    runs = {}
    for precision in ("fp32", "bf16"):
        runs[precision] = one_process(tmp_path_factory.mktemp(f"one-{precision}"), shared_corpus,
                                      f"train.max_steps={STEPS}", f"train.precision={precision}")
    return runs


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layout_across_two_nodes_follows_the_one_process_run(cluster, shared, shared_corpus, references, name):
    overrides, options, precision = LAYOUTS[name]
    run_dir = shared / "run"
    args = tiny(shared_corpus, f"train.max_steps={STEPS}", f"train.precision={precision}", *overrides,
                "logging.wandb.mode=offline", f"train.checkpoint_interval={STEPS}")
    job_id = submit(cluster, run_dir, args, options)
    ended = wait_job(cluster, job_id, f"{run_dir}.slurm.out")
    assert (ended.state, ended.exit_code) == ("COMPLETED", 0), ended.output[-3000:]

    ranks = 2 * int(options[1].split("=")[1])
    tp, pp = (2 if "parallel.tp=2" in overrides else 1), (2 if "parallel.pp=2" in overrides else 1)
    assert f"{ranks} process(es) on cpu (tp={tp} pp={pp} dp={ranks // tp // pp} zero=0)" in ended.output
    assert_same_losses(metrics(run_dir), references[precision], precision)

    # one run folder: one metrics file, one offline W&B run, the checkpoint's parts from every saving rank
    assert [p.relative_to(run_dir).as_posix() for p in run_dir.rglob("metrics.jsonl")] == ["metrics.jsonl"]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    step = run_dir / "checkpoints" / f"step{STEPS:08d}"
    manifest = json.loads((step / "manifest.json").read_text())
    shards = sorted(p.name for p in step.glob("shard-*.safetensors"))
    assert shards and all(name in manifest["files"] for name in shards)
    if pp == 2:  # each stage's rank, one a node, saved its own part
        assert len(shards) == 2
    for node in cluster.nodes:  # tiktoken's cache of the BPE files may be there: a cache, made again at will
        assert [f for f in node_local_files(cluster, node) if not f.startswith("/tmp/data-gym-cache/")] == [], node
