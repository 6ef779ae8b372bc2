"""The run specification (train/run/spec.py): the config checked and resolved once, never changed.

A real 2-step run (through `python -m train`) leaves a checkpoint whose global batch is 4. Resuming it
with train.global_batch_size=8 keeps the checkpoint's schedule, batch included: the run follows 4, but
the caller's config must still say 8 after any number of resolutions. A whole resumed run (its own
process) counts how often the model config, the batch ramp, the LR schedule and the plan are built and
how often state.json is read: once each.
"""

from __future__ import annotations

import copy

import pytest
from cli import TINY, train
from distributed import run_distributed
from omegaconf import OmegaConf


def compose(corpus, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_config

    register_config()
    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="test"):
        return hydra_compose("config", overrides=[*TINY, f"data.paths=[{corpus}/*.txt]",
                                                  "logging.wandb.mode=disabled", *overrides])


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("spec") / "run"
    train(run_dir, corpus, "train.max_steps=2", "train.eval_interval=0", "logging.wandb.mode=disabled")
    return run_dir


def test_resolving_never_changes_the_config(two_steps, corpus, tmp_path):
    from train.run.spec import resolve

    cfg = compose(corpus, [f"train.resume={two_steps}", "train.max_steps=3", "train.global_batch_size=8"])
    before = copy.deepcopy(OmegaConf.to_container(cfg))
    first = resolve(cfg, tmp_path / "resumed")
    second = resolve(cfg, tmp_path / "resumed")
    assert OmegaConf.to_container(cfg) == before  # both resolutions left the caller's config as it was
    assert cfg.train.global_batch_size == 8
    for spec in (first, second):  # the run follows the checkpoint's batch (the kept schedule)
        assert spec.sections.train.global_batch_size == 4 and spec.ramp.full == 4
        assert spec.resume.folder.name == "step00000002" and spec.resume.state["step"] == 2


def counted_run(corpus: str, run_dir: str) -> dict:
    """A resumed run in this process with every builder under count; the plan is computed as on a GPU
    (the device check answers cuda while the specification is resolved)."""
    import dataclasses

    import torch

    import train.checkpoint.files
    import train.planner.from_config
    import train.run.batch_ramp
    import train.run.schedule
    import train.runtime.resolve
    from model.config import GPTConfig
    from train.run import loop
    from train.run import spec as specs
    from train.runtime.resolve import resolve_runtime

    counts = {"model config": 0, "batch ramp": 0, "lr schedule": 0, "plan": 0, "state.json": 0}

    def counting(key, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    from_dict = GPTConfig.from_dict.__func__
    GPTConfig.from_dict = classmethod(counting("model config", from_dict))
    train.run.batch_ramp.from_config = counting("batch ramp", train.run.batch_ramp.from_config)
    train.run.schedule.make_schedule = counting("lr schedule", train.run.schedule.make_schedule)
    train.planner.from_config.plan_for_run = counting("plan", train.planner.from_config.plan_for_run)
    read_json = train.checkpoint.files.read_json

    def reading(path):
        counts["state.json"] += path.name == "state.json"
        return read_json(path)

    train.checkpoint.files.read_json = reading
    cfg = compose(corpus, [f"train.resume={run_dir}", "train.max_steps=3", "train.eval_interval=0"])
    on_cpu = train.runtime.resolve.resolve_device
    train.runtime.resolve.resolve_device = lambda requested: torch.device("cuda")
    try:
        spec = specs.resolve(cfg, run_dir)
    finally:
        train.runtime.resolve.resolve_device = on_cpu
    # the plan is the faked GPU's; the run itself trains on this CPU
    spec = dataclasses.replace(spec, runtime=resolve_runtime(spec.sections.train))
    progress = loop.run(spec)
    return {"counts": counts, "step": progress.step, "planned": spec.plan is not None}


def test_each_part_of_the_specification_is_computed_once_per_run(two_steps, corpus, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    [result] = run_distributed(counted_run, 1, str(corpus), str(run_dir), timeout=300)
    assert result["step"] == 3 and result["planned"]
    assert result["counts"] == {"model config": 1, "batch ramp": 1, "lr schedule": 1, "plan": 1, "state.json": 1}
    assert (run_dir / "plan.json").is_file()
