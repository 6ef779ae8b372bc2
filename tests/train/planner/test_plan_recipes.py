"""The recipes in configs/recipe/: each composes with the training config, is a layout the planner
accepts, fits with the default headroom (pre-flight passes), and its shards cover the model (the
dry run). The 175B recipe's dry run builds its 128 shards at one block per stage (model.n_layer=16:
the same tp × pp shards with fewer blocks, seconds instead of minutes); 13B's builds the model whole."""

from __future__ import annotations

import os

import pytest

from train.plan import load
from train.planner.dry_run import dry_run
from train.planner.from_config import plan_from_config, preflight, stage_split

RECIPES = {  # recipe: (GPUs, the model it sets, layout it must hold, blocks for the dry run, precision)
    # the whole 96 blocks: 12 chunks of one block on each of the 8 ranks
    "gpt3-175b-h100x1024": (1024, "gpt3-175b", "tp=8 pp=8 dp=16 zero=1 micro=3 ckpt=selective sp interleaved V=12",
                            None, "bf16"),
    # the bf16 recipe's layout with micro batches of 4
    "gpt3-175b-h100x1024-fp8": (1024, "gpt3-175b",
                                "tp=8 pp=8 dp=16 zero=1 micro=4 ckpt=selective sp interleaved V=12", None, "fp8"),
    "gpt3-13b-h100x64": (64, "gpt3-13b", "tp=2 pp=1 dp=32 zero=2 micro=8 ckpt=selective", None, "bf16"),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_fits_passes_preflight_and_its_shards_cover_the_model(recipe):
    gpus, model, layout, blocks, precision = RECIPES[recipe]
    sections, plan_cfg, model_cfg = load([f"+recipe={recipe}", f"plan.gpus={gpus}"])
    plan = plan_from_config(sections, plan_cfg, model_cfg)
    assert plan.model.name == model and plan.layout.describe() == layout
    assert plan.implementation.precision == precision and plan.fits
    assert plan.peak_memory_gib + 2 <= plan.hardware.memory_gib  # the headroom pre-flight leaves
    preflight(plan)  # raises ConfigError when the layout does not fit
    assert plan.predicted_mfu >= 0.40
    shrunk = load([f"+recipe={recipe}", f"model.n_layer={blocks}"])[2] if blocks else model_cfg
    tp, pp = sections.parallel.tp, sections.parallel.pp
    before = dict(os.environ)
    report = dry_run(shrunk, tp, pp, split=stage_split(sections.parallel))
    assert report.ok, report.problems[:5]
    assert report.shards == tp * pp
    assert dict(os.environ) == before  # no LOCAL_RANK left behind: lm-eval's model would take it for a launch


def test_the_13b_recipe_gives_deepspeed_one_block_per_bucket_and_overlapped_reduction():
    """On CUDA the engine's ZeRO settings come from the plan: buckets of one block's parameters on a
    rank, counted here from the block's shapes (12·d² + 7·d of tensor-parallel matrices and vectors,
    split over tp, and 6·d replicated: the row layers' biases and both LayerNorms)."""
    import torch

    from train.run.engine import deepspeed_config
    from train.runtime.resolve import Runtime

    sections, plan_cfg, model_cfg = load(["+recipe=gpt3-13b-h100x64", "plan.gpus=64"])
    plan = plan_from_config(sections, plan_cfg, model_cfg)
    d, tp = plan.model.d_model, sections.parallel.tp
    run = (sections.train, sections.parallel, sections.optim, sections.deepspeed, 64 // tp, Runtime(torch.device("cuda"), "bf16"))
    zero = deepspeed_config(*run, plan)["zero_optimization"]
    block = (12 * d * d + 7 * d) // tp + 6 * d
    assert zero["stage"] == 2 and zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == block
    assert deepspeed_config(*run)["zero_optimization"] == {"stage": 2}
