"""parallel.pipeline_schedule=zb-h1 reproduces the one-process loss curve, and resumes across schedules.

Each case starts `python -m train` on gloo ranks (forked with a launcher's environment, tests/helpers/warm.py) with the ZB-H1 schedule
(parallel/zero_bubble.py: weight gradients deferred, asynchronous sends) and compares its metrics.jsonl
with the one-process run of the same config, seed, data and precision, within the precision's
tolerance (cli.TOLERANCES), in fp32 and in bf16 (DeepSpeed's bf16 optimizer, as on a GPU). The model
has 4 blocks so that pp=4 has one per stage; 4 micro batches per step (2 per replica at dp=2).
"""

from __future__ import annotations

import pytest
from cli import assert_same_losses, metrics, train, write_corpus

BASE = ["train.eval_interval=0", "logging.wandb.mode=disabled", "model.n_layer=4",
        "optim.warmup_tokens=16"]  # one LR schedule for runs of 2 to 6 steps
ZB = "parallel.pipeline_schedule=zb-h1"
PRECISIONS = ["fp32", "bf16"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus):
    """{precision: the one-process run's 6 steps}."""
    runs = {}
    for precision in PRECISIONS:
        run_dir = tmp_path_factory.mktemp(f"one_{precision}")
        train(run_dir, corpus, *BASE, "train.max_steps=6", "train.checkpoint_interval=0", f"train.precision={precision}")
        runs[precision] = metrics(run_dir)
    return runs


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "nproc, layout",
    [(4, ["parallel.pp=4"]), (4, ["parallel.tp=2", "parallel.pp=2"]), (4, ["parallel.pp=2", "parallel.zero_stage=1"])],
    ids=["pp4", "tp2-pp2", "pp2-dp2-zero1"],
)
def test_zb_h1_layout_matches_one_process(tmp_path, corpus, one_process, nproc, layout, precision):
    proc = train(tmp_path, corpus, *BASE, "train.max_steps=2", "train.checkpoint_interval=0", ZB, *layout,
                 f"train.precision={precision}", kind="ranks", nproc=nproc)
    assert "zb-h1)" in proc.stdout  # the run says which schedule it runs
    assert_same_losses(metrics(tmp_path), one_process[precision][:2], precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_pp2_zb_h1_resumes_1f1b_checkpoints_and_back(tmp_path, corpus, one_process, precision):
    """pp=2: steps 1–2 under zb-h1, then resumed under 1f1b for steps 3–4, then under zb-h1 again for
    5–6: one curve, the one-process run's."""
    run = [*BASE, f"train.precision={precision}", "parallel.pp=2"]
    for last, schedule in ((2, "zb-h1"), (4, "1f1b"), (6, "zb-h1")):
        proc = train(tmp_path, corpus, *run, f"train.max_steps={last}", f"parallel.pipeline_schedule={schedule}",
                     kind="ranks", nproc=2)
        assert last == 2 or "resumed from" in proc.stdout
    assert_same_losses(metrics(tmp_path), one_process[precision], precision)


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (1, [ZB], "parallel.pipeline_schedule=zb-h1 schedules pipeline stages: it needs parallel.pp > 1"),
        (2, [ZB, "parallel.pp=2", "model.compile=true"], "parallel.pipeline_schedule=zb-h1 with model.compile=true"),
    ],
)
def test_bad_schedule_fails_before_any_model_is_built(tmp_path, corpus, world, overrides, message):
    run_dir = tmp_path / "bad"
    proc = train(run_dir, corpus, *overrides, check=False, env={"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()
