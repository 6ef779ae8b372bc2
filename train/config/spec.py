"""The run specification: the Hydra config checked and resolved once, before anything is built.

`resolve(cfg, run_dir)` runs every check of train/config/checks.py in order and keeps what they give:

  model      the GPTConfig (built once from model.*)
  dp         the data-parallel size of WORLD_SIZE at parallel.tp × parallel.pp
  resume     the checkpoint a resume starts from, with its state.json (read once), or None
  cfg        the config the run follows: the composed one, except that a resume keeping its
             checkpoint's schedule takes back the checkpoint's batch settings (global batch, ramp);
             a copy, so the caller's config is never changed
  ramp       the batch ramp (global batch size by tokens seen)
  schedule   the LR schedule and what checkpoints record of it
  plan       the planner's prediction for this run on the visible GPU (CUDA only; None on CPU),
             after pre-flight: a run predicted not to fit stops here

The build and the loop read only a RunSpec. Any bad value is one ConfigError before heavy work.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from model import GPTConfig
from train.batch_ramp import BatchRamp
from train.checkpoint.resume_checks import (
    KeptSchedule,
    ResumePoint,
    RunSchedule,
    kept_schedule,
    recorded_schedule,
    schedule_for_run,
)
from train.config import checks
from train.config.checks import ConfigError
from train.config.launch import is_rank_zero


@dataclass(frozen=True)
class RunSpec:
    cfg: object  # the config the run follows (see the module docstring): read, never written
    run_dir: Path
    model: GPTConfig
    dp: int
    resume: ResumePoint | None
    ramp: BatchRamp
    schedule: RunSchedule
    plan: object | None  # train/plan/estimate.py's Plan, on CUDA

    @property
    def run_tokens(self) -> int:
        """Tokens trained on by train.max_steps."""
        return self.ramp.tokens_after(self.cfg.train.max_steps)


def resolve(cfg, run_dir: Path) -> RunSpec:
    """Check the whole run config for a run in `run_dir` and resolve it (see the module docstring).
    Raises ConfigError."""
    run_dir = Path(run_dir)
    model_cfg = checks.check_model(cfg)
    checks.check_train(cfg)
    resume = checks.check_resume(cfg, run_dir, model_cfg)
    checks.check_checkpoint_settings(cfg, model_cfg)
    saved_schedule = recorded_schedule(resume.state if resume is not None else None)
    kept = kept_schedule(saved_schedule, cfg)
    if kept.note and is_rank_zero():
        print(f"gpt3d: note: {kept.note}", flush=True)
    cfg = _following(cfg, kept)
    dp = checks.check_parallel(cfg, model_cfg)
    checks.check_batches(cfg, dp)
    streams = checks.check_data(cfg, dp)
    ramp = checks.check_batch_ramp(cfg, model_cfg, dp, streams)
    checks.check_optim(cfg)
    try:
        schedule = schedule_for_run(cfg, model_cfg.name, ramp.tokens_after(cfg.train.max_steps), kept, saved_schedule)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return RunSpec(cfg, run_dir, model_cfg, dp, resume, ramp, schedule, _plan(cfg, model_cfg))


def _following(cfg, kept: KeptSchedule):
    """`cfg`, or a copy of it with the batch settings a kept schedule takes back."""
    if not kept.batch:
        return cfg
    cfg = copy.deepcopy(cfg)
    for key, value in kept.batch.items():
        OmegaConf.update(cfg, key, value)
    return cfg


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
