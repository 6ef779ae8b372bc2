"""gpt3d's own pipeline schedules (parallel/schedules/: zb-h1, interleaved, zb-v) reproduce the one-process
loss curve, with uneven stages, compiled blocks, and checkpoints that resume across schedules and layouts.

Each case starts `python -m train` on gloo ranks (forked with a launcher's environment, tests/helpers/warm.py)
and compares its metrics.jsonl with the one-process run of the same config, seed, data and precision, within
the precision's tolerance (cli.TOLERANCES), in fp32 and in bf16 (DeepSpeed's bf16 optimizer, as on a GPU).
The model has 8 blocks, so that pp=4 holds 2 chunks of one block under the interleaved schedule and zb-v,
and pp=2 three chunks (V=3) with parallel.stage_layers splitting the 8 blocks unevenly; 4 micro batches a
step (2 per replica at dp=2).
"""

from __future__ import annotations

import pytest
from cli import TOLERANCES, assert_refused_before_building, assert_same_losses, metrics, train, write_corpus

BASE = ["logging.wandb.mode=disabled", "model.n_layer=8", "optim.warmup_tokens=16"]  # one LR schedule, 2 to 8 steps
NO_EVAL, EVAL = "train.eval_interval=0", "train.eval_interval=2"  # evaluation at steps 2, 4, 6 and 8
PRECISIONS = ["fp32", "bf16"]
ZB_H1, ZB_V = "parallel.pipeline_schedule=zb-h1", "parallel.pipeline_schedule=zb-v"


def interleaved(chunks: int) -> list[str]:
    return ["parallel.pipeline_schedule=interleaved", f"parallel.virtual_stages={chunks}"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus):
    """{precision: the one-process run's 8 steps, evaluated every 2}."""
    runs = {}
    for precision in PRECISIONS:
        run_dir = tmp_path_factory.mktemp(f"one_{precision}")
        train(run_dir, corpus, *BASE, EVAL, "train.max_steps=8", "train.checkpoint_interval=0", f"train.precision={precision}")
        runs[precision] = metrics(run_dir)
    return runs


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "layout, words",
    [
        ([ZB_H1, "parallel.tp=2", "parallel.pp=2", "parallel.stage_layers=[3,5]"], "zb-h1)"),
        ([ZB_H1, "parallel.pp=2", "parallel.zero_stage=1"], "zb-h1)"),
        ([*interleaved(2), "parallel.pp=4"], "interleaved V=2)"),
        ([*interleaved(3), "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
          "parallel.stage_layers=[2,1,1,1,1,2]"], "interleaved V=3)"),
        ([ZB_V, "parallel.pp=2", "parallel.tp=2"], "zb-v)"),
        ([ZB_V, "parallel.pp=2", "parallel.zero_stage=1"], "zb-v)"),
        ([ZB_V, "parallel.pp=4"], "zb-v)"),
    ],
    ids=["zbh1-tp2-pp2-uneven", "zbh1-pp2-dp2-zero1", "interleaved-pp4-V2",
         "interleaved-pp2-V3-tp2-sp-uneven", "zbv-pp2-tp2", "zbv-pp2-dp2-zero1", "zbv-pp4"],
)
def test_schedule_matches_one_process(tmp_path, corpus, one_process, layout, words, precision):
    """(zb-h1 at pp=4: the third leg of the resumed run below.)"""
    proc = train(tmp_path, corpus, *BASE, NO_EVAL, "train.max_steps=2", "train.checkpoint_interval=0", *layout,
                 f"train.precision={precision}", kind="ranks", nproc=4)
    assert words in proc.stdout  # the run says which schedule it runs
    assert_same_losses(metrics(tmp_path), one_process[precision][:2], precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpoints_resume_across_schedules_and_layouts(tmp_path, corpus, one_process, precision):
    """Steps 1–2 interleaved (V=2) at pp=2 × dp=2 (in bf16 each chunk's data-parallel reduction issued after its
    last B: parallel/schedules/grad_reduction.py), 3–4 zb-v at pp=2, 5–6 zb-h1 at pp=4, 7–8 DeepSpeed's 1f1b at
    pp=2, each leg ending in an evaluation (gpt3d's schedules run their forward-only programs for it): one curve,
    the one-process run's, its training and validation losses alike."""
    run = [*BASE, EVAL, f"train.precision={precision}"]
    legs = ((2, [*interleaved(2), "parallel.pp=2"], 4), (4, [ZB_V, "parallel.pp=2"], 2),
            (6, [ZB_H1, "parallel.pp=4"], 4), (8, ["parallel.pp=2"], 2))
    for last, layout, ranks in legs:
        proc = train(tmp_path, corpus, *run, f"train.max_steps={last}", *layout, kind="ranks", nproc=ranks)
        assert last == 2 or "resumed from" in proc.stdout
    got, want = metrics(tmp_path), one_process[precision]
    assert_same_losses(got, want, precision)
    validation = [(r["step"], r["val/loss"]) for r in got if "val/loss" in r]
    assert [step for step, _ in validation] == [2, 4, 6, 8]
    for (step, loss), expected in zip(validation, [r["val/loss"] for r in want if "val/loss" in r], strict=True):
        assert loss == pytest.approx(expected, rel=TOLERANCES[precision][0]), step


@pytest.mark.slow  # CPU inductor compiles the blocks on each rank (later runs find them in its cache)
def test_compiled_blocks_follow_the_eager_run_under_every_schedule(tmp_path, corpus, one_process):
    """model.compile=true at pp=2 under 1f1b, zb-h1, interleaved and zb-v (whose blocks defer W: compiled
    between the deferring linears, and W compiled on its own, model/weight_grads.py): each follows the
    one-process eager run within 1e-4 in fp32."""
    for name, layout in (("1f1b", []), ("zb-h1", [ZB_H1]), ("interleaved", interleaved(2)), ("zb-v", [ZB_V])):
        run_dir = tmp_path / name
        train(run_dir, corpus, *BASE, NO_EVAL, "train.max_steps=2", "train.checkpoint_interval=0", "parallel.pp=2",
              "model.compile=true", *layout, kind="ranks", nproc=2)
        got, want = metrics(run_dir), one_process["fp32"][:2]
        for g, e in zip(got, want, strict=True):
            assert g["train/loss"] == pytest.approx(e["train/loss"], rel=1e-4), name
            assert g["train/grad_norm"] == pytest.approx(e["train/grad_norm"], rel=1e-4), name


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (1, [ZB_H1], "parallel.pipeline_schedule=zb-h1 schedules pipeline stages: it needs parallel.pp > 1"),
        (2, ["parallel.pp=2", "parallel.virtual_stages=2"], "parallel.virtual_stages=2 with parallel.pipeline_schedule=1f1b"),
        (2, [*interleaved(8), "parallel.pp=2"], "runs 16 virtual stages: model.n_layer=3 gives fewer than one block each"),
        (2, [ZB_V, "parallel.pp=2", "parallel.stage_layers=[1,2]"],
         "parallel.stage_layers=[1, 2]: 2 counts for 4 virtual stages"),
        (2, [ZB_H1, "parallel.pp=2", "parallel.stage_layers=[1,1]"], "parallel.stage_layers=[1, 1] holds 2 blocks"),
        (2, [*interleaved(3), "parallel.pp=2", "model.n_layer=6", "train.global_batch_size=5"],
         "parallel.pipeline_schedule=interleaved runs micro batches in groups of pp=2: train.global_batch_size=5"),
    ],
    ids=["zb-h1-without-pipeline", "chunks-without-interleaving", "more-stages-than-blocks", "stage-count",
         "block-count", "micro-batches-not-in-groups-of-pp"],
)
def test_bad_schedule_fails_before_any_model_is_built(tmp_path, corpus, world, overrides, message):
    assert_refused_before_building(tmp_path / "bad", corpus, world, overrides, message)
