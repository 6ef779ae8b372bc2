"""Every parallel layout reproduces the one-process loss curve, through the real launchers, in fp32
and in bf16 (train.precision=bf16: what a GPU runs by default, bf16 weights with fp32 masters in
DeepSpeed's optimizer, forced here on the CPU).

Each case starts `python -m train` on gloo processes on the CPU (under torchrun or the deepspeed launcher,
or as ranks forked with a launcher's environment by the warm interpreter, tests/helpers/warm.py) and
compares its metrics.jsonl with the one-process run of the same config, seed, data,
global batch (4 sequences) and precision: per-step training loss and gradient norm within the
precision's tolerance (cli.TOLERANCES: 1e-5 and 1e-4 relative in fp32; one bf16 rounding of the loss,
2^-8, and 1% of the norm in bf16).
"""

from __future__ import annotations

import pytest
from cli import assert_refused_before_building, assert_same_losses, metrics, train, write_corpus

STEPS = ["train.max_steps=3", "train.eval_interval=0", "train.checkpoint_interval=0", "logging.wandb.mode=disabled"]
PRECISIONS = ["fp32", "bf16"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("one_process")
    train(run_dir, corpus, *STEPS)
    return metrics(run_dir)


@pytest.fixture(scope="module")
def one_process_bf16(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("one_process_bf16")
    train(run_dir, corpus, *STEPS, "train.precision=bf16")
    return metrics(run_dir)


def reference(request, precision: str) -> list[dict]:
    """The one-process run's metrics in `precision` (each fixture runs once per module)."""
    return request.getfixturevalue("one_process" if precision == "fp32" else "one_process_bf16")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "kind, nproc, layout",
    [
        ("ranks", 2, ["parallel.tp=2"]),
        # (pp=2 alone: tests/end_to_end/test_zero_bubble.py, its steps under zb-h1 and, resumed, 1f1b)
        ("ranks", 3, ["parallel.pp=3"]),  # one block per stage
        ("torchrun", 4, ["parallel.tp=2", "parallel.pp=2"]),
        ("ranks", 2, ["parallel.zero_stage=1"]),
        ("deepspeed", 2, ["parallel.zero_stage=2"]),
        ("ranks", 2, ["parallel.zero_stage=3"]),
        ("ranks", 2, ["parallel.zero_stage=1", "parallel.offload_optimizer=true"]),
        # ZeRO's reduction in small buckets, overlapped with backward as the planner sets it on GPUs
        # (train/planner/zero_buckets.py): several buckets per step
        ("ranks", 4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=2",
                         "parallel.activation_checkpointing=selective",
                         "+deepspeed.zero_optimization={overlap_comm:true,contiguous_gradients:true,"
                         "reduce_bucket_size:20000,allgather_bucket_size:20000}"]),
        ("deepspeed", 2, ["parallel.pp=2", "parallel.activation_checkpointing=1"]),
        # sequence parallelism's collectives in ring steps behind the GEMM chunks (parallel/overlap.py): with
        # ZeRO-1 and selective recomputation, and with a pipeline whose blocks defer their weight gradients
        ("ranks", 4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true",
                      "parallel.zero_stage=1", "parallel.activation_checkpointing=selective"]),
        ("ranks", 4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                      "parallel.tp_comm_overlap=true", "parallel.pipeline_schedule=zb-h1"]),
    ],
    ids=["tp2", "pp3", "tp2-pp2", "zero1-dp2", "zero2-dp2-deepspeed", "zero3-dp2", "offload-dp2",
         "tp2-sp-dp2-zero2-selective-buckets", "pp2-ckpt-deepspeed", "tp2-sp-ring-dp2-zero1-selective",
         "tp2-sp-ring-pp2-zbh1"],
)
def test_layout_matches_one_process(request, tmp_path, corpus, kind, nproc, layout, precision):
    """The launcher named starts the fp32 case; the bf16 case of the same layout is forked ranks (a launcher
    only hands out the environment, the same in both precisions, and a fresh interpreter per rank is seconds)."""
    kind = kind if precision == "fp32" else "ranks"
    train(tmp_path, corpus, *STEPS, *layout, f"train.precision={precision}", kind=kind, nproc=nproc)
    assert_same_losses(metrics(tmp_path), reference(request, precision), precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_3d_layout_on_8_processes_matches_one_process_and_resumes_exactly(tmp_path, corpus, precision):
    """tp=2 × pp=2 × dp=2 with ZeRO-1, selective recomputation and tensor-parallel overlap (the
    default): its 4 steps follow the one-process run of the same precision, and the same layout
    resumed from its step-2 checkpoint in another process group continues with exactly the
    uninterrupted 8-process run's losses."""
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", "parallel.activation_checkpointing=selective"]
    one, straight, resumed = tmp_path / "one", tmp_path / "straight", tmp_path / "resumed"
    run = ["train.eval_interval=0", "logging.wandb.mode=disabled", "train.max_steps=4", f"train.precision={precision}"]
    train(one, corpus, *run, "train.checkpoint_interval=0")
    train(straight, corpus, *run, "train.checkpoint_interval=2", *layout, kind="ranks", nproc=8)
    assert [r["step"] for r in metrics(straight)] == [1, 2, 3, 4]
    assert_same_losses(metrics(straight), metrics(one), precision)
    proc = train(resumed, corpus, *run, f"train.resume={straight}/checkpoints/step00000002", *layout, kind="ranks", nproc=8)
    assert "resumed from" in proc.stdout
    keys = ("step", "train/loss", "train/lr", "train/grad_norm")
    assert [[r[k] for k in keys] for r in metrics(resumed)] == [[r[k] for k in keys] for r in metrics(straight)[2:]]


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (4, ["parallel.tp=3"], "world size 4 is not a multiple of tp·pp"),
        (2, ["parallel.tp=2", "model.n_head=3", "model.d_model=30"], "parallel.tp=2 does not divide model.n_head=3"),
        (4, ["parallel.pp=4"], "parallel.pp=4 exceeds model.n_layer=3"),
        (2, ["parallel.pp=2", "parallel.zero_stage=2"], "parallel.zero_stage=2 with parallel.pp=2"),
        (2, ["train.micro_batch_size=3"], "not divisible by train.micro_batch_size=3 × data-parallel size 2"),
        (2, ["parallel.offload_optimizer=true"], "needs parallel.zero_stage ≥ 1"),
        (1, ["+deepspeed.train_batch_size=8"], "deepspeed.train_batch_size is set by gpt3d from train.global_batch_size"),
        (1, ["+deepspeed.zero_optimisation={}"], "did you mean ['zero_optimization'"),
        (2, ["parallel.tp=2", "parallel.tp_comm_overlap=true"], "it needs parallel.sequence_parallel=true"),
        (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true",
             "train.precision=fp8", "train.fp8_recipe=rowwise", "train.fp8_linears=all"],
         "parallel.tp_comm_overlap=true with train.fp8_recipe=rowwise"),
    ],
)
def test_impossible_layout_fails_before_any_model_is_built(tmp_path, corpus, world, overrides, message):
    """As a launcher would start rank 0 of `world` processes; the check runs before rendezvous."""
    assert_refused_before_building(tmp_path / "bad", corpus, world, overrides, message)
