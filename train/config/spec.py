"""The run specification: the Hydra config checked and resolved once, before anything is built.

`resolve(cfg, run_dir)` runs every check of train/config/checks.py in order and keeps what they give:

  model      the GPTConfig (built once from model.*)
  dp         the data-parallel size of WORLD_SIZE at parallel.tp × parallel.pp
  resume     the checkpoint a resume starts from, with its state.json (read once), or None
  folder     the run folder, checked to be usable and not another run's (train/config/run_folder.py),
             with where train.resume=overwrite moves the old run (moved by the entry point, not here)
  cfg        the config the run follows: the composed one, except that a resume keeping its
             checkpoint's schedule takes back the checkpoint's batch settings (global batch, ramp),
             and data.streams, when the user left it at its default and the corpus has too few
             documents for it, is the smaller value the data probe resolved, and parallel.layout=auto's
             choice is in place of the layout keys it sets; a copy, so the
             caller's config is never changed
  ramp       the batch ramp (global batch size by tokens seen)
  schedule   the LR schedule and what checkpoints record of it
  layout     with parallel.layout=auto, the layout train/plan/elastic.py chose for WORLD_SIZE on this
             device (its parallel.* and train.micro_batch_size values are in `cfg`); None with manual
  plan       the planner's prediction for this run on the visible GPU (CUDA only; None on CPU),
             after pre-flight: a run predicted not to fit stops here

The build and the loop read only a RunSpec. Any bad value is one ConfigError before heavy work.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from model import GPTConfig
from train.batch_ramp import BatchRamp
from train.checkpoint.resume_checks import (
    ResumePoint,
    RunSchedule,
    kept_schedule,
    recorded_schedule,
    schedule_for_run,
)
from train.config import checks
from train.config.checks import ConfigError
from train.config.launch import is_rank_zero
from train.config.run_folder import RunFolder, check_run_folder


@dataclass(frozen=True)
class RunSpec:
    cfg: object  # the config the run follows (see the module docstring): read, never written
    run_dir: Path
    model: GPTConfig
    dp: int
    resume: ResumePoint | None
    folder: RunFolder
    ramp: BatchRamp
    schedule: RunSchedule
    plan: object | None  # train/plan/estimate.py's Plan, on CUDA
    layout: object | None = None  # train/plan/elastic.py's LayoutChoice, with parallel.layout=auto

    @property
    def run_tokens(self) -> int:
        """Tokens trained on by train.max_steps."""
        return self.ramp.tokens_after(self.cfg.train.max_steps)


def resolve(cfg, run_dir: Path, overrides: tuple[str, ...] | list[str] = ()) -> RunSpec:
    """Check the whole run config for a run in `run_dir` and resolve it (see the module docstring);
    `overrides` are the command line's, which say what the user set explicitly. Raises ConfigError."""
    run_dir = Path(run_dir)
    model_cfg = checks.check_model(cfg)
    checks.check_train(cfg)
    resume = checks.check_resume(cfg, run_dir, model_cfg)
    folder = check_run_folder(run_dir, cfg.train.resume, resume.path if resume is not None else None)
    checks.check_checkpoint_settings(cfg, model_cfg)
    saved_schedule = recorded_schedule(resume.state if resume is not None else None)
    kept = kept_schedule(saved_schedule, cfg)
    if kept.note and is_rank_zero():
        print(f"gpt3d: note: {kept.note}", flush=True)
    cfg = _with_values(cfg, kept.batch)  # a kept schedule takes back the checkpoint's batch settings
    layout = _auto_layout(cfg, model_cfg, overrides)
    if layout is not None:
        cfg = _with_values(cfg, layout.values())
    dp = checks.check_parallel(cfg, model_cfg)
    checks.check_batches(cfg, dp)
    streams = checks.check_data(cfg, dp, streams_set=_sets(overrides, "data.streams"))
    cfg = _with_values(cfg, {"data.streams": streams})  # as the data probe resolved it
    ramp = checks.check_batch_ramp(cfg, model_cfg, dp, streams)
    checks.check_optim(cfg)
    try:
        schedule = schedule_for_run(cfg, model_cfg.name, ramp.tokens_after(cfg.train.max_steps), kept, saved_schedule)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return RunSpec(cfg, run_dir, model_cfg, dp, resume, folder, ramp, schedule, _plan(cfg, model_cfg), layout)


def _with_values(cfg, values: dict):
    """`cfg` itself when it already holds `values` ({dotted key: value}; a key it lacks counts as held),
    else a copy that does: the caller's config is never changed."""
    if all(OmegaConf.select(cfg, key, default=value) == value for key, value in values.items()):
        return cfg
    cfg = copy.deepcopy(cfg)
    for key, value in values.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def _sets(overrides, key: str) -> bool:
    """Whether the command line sets `key` (as key=..., +key=... or ++key=...)."""
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)


def _auto_layout(cfg, model_cfg: GPTConfig, overrides):
    """With parallel.layout=auto: the layout train/plan/elastic.py chooses for this launch's world size and
    device, for the global batch and data order the run keeps (one line on rank 0 says which and why);
    None with manual. Every rank computes the same choice from the same inputs."""
    from train.plan.elastic import DataOrder, choose_layout

    if checks.check_layout_mode(cfg, [o.lstrip("+").split("=", 1)[0] for o in overrides]) != checks.AUTO:
        return None
    from train.batch_ramp import from_config
    from train.data.sources import resolve as resolve_data
    from train.engine import resolve_device

    processes = checks.world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(processes, 8)))
    try:
        ramp = from_config(cfg.train, model_cfg.seq_len)
        order = DataOrder(resolve_data(cfg.data).streams, (ramp.start, ramp.increment) if ramp.enabled else None)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    hardware = None
    if resolve_device(cfg.train.device).type == "cuda":
        from train.plan.hardware import for_cuda_device

        hardware = for_cuda_device(int(os.environ.get("LOCAL_RANK", 0)))
    choice = choose_layout(model_cfg, processes, cfg.train.global_batch_size, order, hardware, per_node)
    if is_rank_zero():
        print(f"gpt3d: {choice.line()}", flush=True)
    return choice


def _plan(cfg, model_cfg: GPTConfig):
    """On CUDA: the planner's prediction for this run, which must fit the device (pre-flight)."""
    from train.engine import resolve_device

    if resolve_device(cfg.train.device).type != "cuda":
        return None
    from train.plan.config import plan_for_run, preflight

    try:
        plan = plan_for_run(cfg, model_cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    preflight(plan)
    return plan
