"""train.precision=fp8 through `python -m train`: loss parity with bf16, layout invariance, resume both ways.

The fp8 runs put some of the blocks' linears in float8 and leave the others in bf16 (MIXED, through
train.fp8_linears: a column- and a row-parallel layer each way), as the rule does at GPT-3's small sizes;
at the tiny model's shapes the rule itself (train.fp8_linears=auto) would leave every linear in bf16
(its choices at GPT-3's sizes: tests/train/planner/test_fp8_rule.py). The run's second line says which.
Two one-process runs of the tiny model (cli.TINY) for PARITY_STEPS steps, one in fp8 and one in bf16,
are shared by every case here:
  parity   the fp8 run's final training and validation losses within 2% of the bf16 run's, its
           gradient norms finite throughout (the issue asks for 200 steps of the toy model: each run
           took over half an hour on the 2 CPU cores under other jobs' load, far too long for CI; those
           figures are in docs/gpu-values.md)
  layouts  tp=2, pp=2 and tp=2·pp=2 fp8 runs on gloo ranks reproduce the one-process fp8 run's first
           steps within bf16's tolerance (cli.TOLERANCES["bf16"]): every amax of a split operand is
           reduced over the tensor-parallel ranks, so each layout quantizes as one process does, the
           bf16 linears beside the float8 ones alike; also tp=2 with the ring overlap, whose float8 pieces
           travel quantized and whose weight casts are kept through each step (a cast kept past the
           optimizer's update would part from the one-process run at the second step)
  resume   the fp8 run's checkpoint resumes at bf16 at tp=2, and the bf16 run's resumes at fp8 (rowwise),
           each continuing its run within 2% (the same weights, another precision of the products)
"""

from __future__ import annotations

import math

import pytest
from cli import assert_same_losses, metrics, train

PARITY_STEPS = 60
PARITY = 0.02  # relative: fp8 against bf16 (the 2%)
LAYOUT_STEPS = 3
QUIET = ["logging.wandb.mode=disabled", f"train.max_steps={PARITY_STEPS}"]
RUN = [*QUIET, f"train.eval_interval={PARITY_STEPS}", f"train.checkpoint_interval={PARITY_STEPS - 2}"]
MIXED = "train.fp8_linears=[attn.qkv,mlp.proj]"  # float8: a column- and a row-parallel layer; bf16: the others
MIXED_LINE = ("fp8 {recipe}: 6 of 12 block linears in float8 (attn.qkv, mlp.proj; attn.proj, mlp.fc in bf16), head in "
              "bf16, as train.fp8_linears=[attn.qkv,mlp.proj] says; blocks eager: on cpu the float8 products are emulated")


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("fp8")
    proc = train(run_dir, corpus, *RUN, "train.precision=fp8", MIXED)
    assert MIXED_LINE.format(recipe="tensorwise") in proc.stdout.splitlines()[1]  # the run's second line
    return run_dir


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("bf16")
    train(run_dir, corpus, *RUN, "train.precision=bf16")
    return run_dir


@pytest.mark.slow
def test_fp8_trains_like_bf16(fp8_run, bf16_run):
    fp8, bf16 = metrics(fp8_run), metrics(bf16_run)
    assert [r["step"] for r in fp8] == [r["step"] for r in bf16] == list(range(1, PARITY_STEPS + 1))
    assert all(math.isfinite(r["train/grad_norm"]) for r in fp8)
    assert fp8[-1]["train/loss"] < fp8[0]["train/loss"] - 1.0  # it did learn (nats)
    assert fp8[-1]["train/loss"] != bf16[-1]["train/loss"]  # the products did run in another precision
    for key in ("train/loss", "val/loss"):
        assert fp8[-1][key] == pytest.approx(bf16[-1][key], rel=PARITY), key


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, layout",
    [(2, ["parallel.tp=2"]), (2, ["parallel.pp=2"]), (4, ["parallel.tp=2", "parallel.pp=2"]),
     (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"])],
    ids=["tp2", "pp2", "tp2-pp2", "tp2-sp-ring"],
)
def test_fp8_layout_matches_one_process(tmp_path, corpus, fp8_run, nproc, layout):
    train(tmp_path, corpus, "logging.wandb.mode=disabled", f"train.max_steps={LAYOUT_STEPS}", "train.eval_interval=0",
          "train.checkpoint_interval=0", "train.precision=fp8", MIXED, *layout, kind="ranks", nproc=nproc)
    assert_same_losses(metrics(tmp_path), metrics(fp8_run)[:LAYOUT_STEPS], "bf16")


def resume(source, run_dir, corpus, *overrides, wandb: str = "disabled", **launch) -> list[dict]:
    """The last two steps of `source`'s run, resumed from its checkpoint in `run_dir` with `overrides`."""
    checkpoint = source / "checkpoints" / f"step{PARITY_STEPS - 2:08d}"
    train(run_dir, corpus, f"logging.wandb.mode={wandb}", f"train.max_steps={PARITY_STEPS}", "train.eval_interval=0",
          f"train.resume={checkpoint}", *overrides, **launch)
    return metrics(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["fp8 to bf16 at tp=2", "bf16 to fp8 rowwise"])
def test_a_checkpoint_resumes_in_the_other_precision(tmp_path, corpus, fp8_run, bf16_run, direction):
    if direction == "fp8 to bf16 at tp=2":
        source, resumed = fp8_run, resume(fp8_run, tmp_path, corpus, "train.precision=bf16", "parallel.tp=2",
                                          kind="ranks", nproc=2)
    else:  # W&B's config records which linears ran in float8 (offline: its run file)
        source, resumed = bf16_run, resume(bf16_run, tmp_path, corpus, "train.precision=fp8",
                                           "train.fp8_recipe=rowwise", MIXED, wandb="offline")
        import wandb_log

        (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
        config = wandb_log.run_file(run_file)["config"]
        fp8 = (config["run"]["value"] if "value" in config["run"] else config["run"])["fp8"]
        assert fp8["line"].startswith(MIXED_LINE.format(recipe="rowwise"))
        assert fp8["linears"] == ["attn.qkv", "mlp.proj"] and fp8["block_linears_fp8"] == 6 and fp8["head"] == "bf16"
    straight = metrics(source)[-2:]
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [PARITY_STEPS - 1, PARITY_STEPS]
    for got, expected in zip(resumed, straight):
        assert got["train/loss"] != expected["train/loss"]
        assert got["train/loss"] == pytest.approx(expected["train/loss"], rel=PARITY)
        assert got["train/lr"] == pytest.approx(expected["train/lr"], rel=1e-12)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.precision=fp8", "train.fp8_recipe=blockwise"],
         "train.fp8_recipe='blockwise': must be one of ['tensorwise', 'rowwise']"),
        (["train.precision=fp16"], "train.precision='fp16': must be one of ['auto', 'fp32', 'autocast', 'bf16', 'fp8']"),
    ],
    ids=["recipe", "precision"],
)
def test_a_bad_precision_setting_is_one_line_before_anything_is_built(tmp_path, corpus, overrides, message):
    run_dir = tmp_path / "refused"
    proc = train(run_dir, corpus, *overrides, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"gpt3d: error: {message}"]
    assert not run_dir.exists()
