"""A checkpoint's training state moves between layouts exactly.

Gloo ranks build the real run (train.run.build.build from the composed config), train two steps on
fixed windows at one layout and save; fresh ranks at other layouts (another tp, pp, ZeRO stage,
offload) resume from it. Each side puts the whole model's fp32 master weights and Adam moments
back together from what every rank holds — DeepSpeed's own gather (safe_get_full_*) or the torch
AdamW's state, placed by parallel.naming's slices — and the resumed state must equal the saved one
bit for bit, as must AdamW's step count and the learning rate. In bf16 (train.precision=bf16, the
GPU default) the same holds for the fp32 masters and moments, and the module's bf16 weights are the
masters rounded to bf16 on both sides.
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_state import save_checkpoint
from cli import TINY
from distributed import run_distributed

from model import GPTConfig
from parallel.naming import full_shapes
from train.run.spec import resolve

MODEL = [o for o in TINY if not o.startswith("data")] + ["model.n_head=4", "train.eval_interval=0",
                                                          "logging.wandb.mode=disabled", "train.sample_tokens=0"]
SAVED_AT = ["parallel.tp=2", "parallel.zero_stage=1"]  # 4 ranks: tp 2 × dp 2


def compose(corpus: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_config

    register_config()

    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="test"):
        return hydra_compose("config", overrides=[*MODEL, "data=files", f"data.paths=[{corpus}/*.txt]", *overrides])


def whole_state(trainer) -> dict:
    """{kind/full name: this rank's region} for the parts this rank speaks for (tp rank 0 for
    replicated ones, never a tied copy), plus the step count and learning rates. The module's
    weights must equal the fp32 master (in bf16: the master rounded to bf16)."""
    from deepspeed.runtime.zero import GatheredParameters

    from parallel.naming import parameter_map
    from train.checkpoint.optimizer_state import ParameterState

    params, part, topology = ParameterState(trainer.engine), trainer.engine.module, trainer.topology
    regions = {}
    for local, shard in parameter_map(part, trainer.model_cfg, topology).items():
        if shard.tied or (shard.replicated and topology.tp_rank != 0):
            continue
        param = part.get_parameter(local)
        values = params.get(param)  # a collective over dp under ZeRO
        with GatheredParameters([param], enabled=params.zero_stage == 3):  # the weights the forward pass uses
            master = values["model"].to(param.dtype)
            assert torch.equal(param.detach().reshape(master.shape), master), local
        for kind, value in values.items():
            bounds = tuple((s.start, s.stop) for s in shard.index)
            regions[(kind, shard.name, bounds)] = (shard.full_shape, value[shard.local_index].detach().cpu().clone())
    return {"regions": regions, "steps": params.step_count(), "lr": trainer.engine.get_lr()}


def save_worker(corpus: str, run_dir: str, precision: str) -> dict:
    from train.run.build import build

    trainer = build(resolve(compose(corpus, [*SAVED_AT, f"train.precision={precision}"]), run_dir))
    windows = torch.randint(0, 50257, (4 // trainer.topology.dp_size, 33), generator=torch.Generator().manual_seed(3))
    progress = trainer.progress
    for _ in range(2):
        trainer.step(windows)
        progress.advance(trainer.ramp.size_at(progress.tokens) * trainer.model_cfg.seq_len)
    save_checkpoint(trainer)
    return whole_state(trainer)


def resume_worker(corpus: str, run_dir: str, layout: list[str]) -> dict:
    from train.run.build import build

    trainer = build(resolve(compose(corpus, [*layout, f"train.resume={run_dir}"]), run_dir + "-resumed"))
    resumed = trainer.checkpointer.restore()
    assert resumed and trainer.progress.step == 2
    return whole_state(trainer)


def assemble(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's regions; each element must be written exactly once."""
    full, count = {}, {}
    for rank in ranks:
        for (kind, name, index), (shape, value) in rank["regions"].items():
            key = f"{kind}/{name}"
            index = tuple(slice(*bounds) for bounds in index)
            full.setdefault(key, torch.full(shape, float("nan")))[index] = value
            count.setdefault(key, torch.zeros(shape, dtype=torch.int))[index] += 1
    for key, n in count.items():
        assert (n >= 1).all(), f"{key} not covered"
    return full


@pytest.fixture(scope="module")
def saved(request, tmp_path_factory, corpus):
    """A checkpoint of 2 steps at SAVED_AT in the precision the test names (indirect parametrization)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    ranks = run_distributed(save_worker, 4, str(corpus), str(run_dir), request.param, timeout=600)
    return corpus, run_dir, ranks, request.param


# fp32 moves to two layouts; bf16 (the fixture's second run) to the first of them, where the pipeline's
# tied copy and the offloaded optimizer meet DeepSpeed's bf16 state
MOVES = {
    "pp2-dp2-zero1-offload": (4, ["parallel.pp=2", "parallel.zero_stage=1", "parallel.offload_optimizer=true"]),
    "dp2-zero3": (2, ["parallel.zero_stage=3"]),
}


@pytest.mark.parametrize("saved, move", [("fp32", "pp2-dp2-zero1-offload"), ("fp32", "dp2-zero3"),
                                         ("bf16", "pp2-dp2-zero1-offload")], indirect=["saved"])
def test_fp32_weights_and_adam_moments_move_exactly(saved, move):
    corpus, run_dir, saved_ranks, precision = saved
    world, layout = MOVES[move]
    resumed_ranks = run_distributed(resume_worker, world, str(corpus), str(run_dir),
                                    [*layout, f"train.precision={precision}"], timeout=600)
    before, after = assemble(saved_ranks), assemble(resumed_ranks)
    names = full_shapes(GPTConfig(n_layer=3, n_head=4, d_model=32, seq_len=32))  # the TINY model's parameters
    kinds = ("model", "exp_avg", "exp_avg_sq")
    assert before.keys() == after.keys() == {f"{kind}/{name}" for name in names for kind in kinds}
    for key, expected in before.items():
        assert torch.equal(after[key], expected), key
    assert before["exp_avg_sq/layers.1.attn.qkv.weight"].abs().sum() > 0  # moments of two real steps
    assert {r["steps"] for r in saved_ranks} == {r["steps"] for r in resumed_ranks} == {2}
    assert {tuple(r["lr"]) for r in resumed_ranks} == {tuple(saved_ranks[0]["lr"])}
