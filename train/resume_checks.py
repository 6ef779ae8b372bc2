"""What a resumed run may change: never the model's shape; its schedule only when asked to.

Every checkpoint records the model config (train/checkpoint.py refuses another model shape) and,
in its client state, the schedule the run trains with ("schedule", `RunSchedule.state`): the
configured SCHEDULE_KEYS and the LR schedule they resolved to (peak, warmup and decay in tokens,
floor). On resume, before anything is built:

- a schedule key that differs (a longer train.max_steps, another optim.lr, …) keeps the checkpoint's
  schedule: its resolved LR schedule and its batch (global batch size and batch ramp);
  train.max_steps still says where the run stops. With train.reset_schedule=true the new values apply instead, evaluated at the step the
  run has reached, as if it had used them from the start. Either way one note says which.

The schedule a run keeps is recorded again in its own checkpoints, so it stays the one the run
started with (or was last reset to), however often the run is resumed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from train import checkpoint
from train.optimizer import Schedule, make_schedule

# What sets the batch each step trains on: a kept schedule keeps these as the checkpoint has them.
BATCH_KEYS = ("train.global_batch_size", "train.batch_ramp.start", "train.batch_ramp.unit",
              "train.batch_ramp.increment", "train.batch_ramp.tokens")
SCHEDULE_KEYS = ("train.max_steps", *BATCH_KEYS, "optim.lr", "optim.warmup_tokens", "optim.decay_tokens",
                 "optim.min_lr_ratio")


@dataclass(frozen=True)
class RunSchedule:
    schedule: Schedule  # the LR schedule this run follows
    state: dict  # what its checkpoints record: {"config": {key: value}, "resolved": Schedule's fields}


def recorded_schedule(state: dict | None) -> dict | None:
    """The schedule a checkpoint's state.json records (the `schedule` entry of its client state), or
    None (no checkpoint, or one that records none)."""
    extra = state.get("extra") if state is not None else None
    return extra.get("schedule") if isinstance(extra, dict) else None


def check_resumed_config(saved: dict, cfg) -> str | None:
    """Compare the configured schedule with `saved`, the one the checkpoint records (see the module
    docstring; the model's shape is checked by train.checkpoint.check_resume_model). Keeping the
    schedule sets the BATCH_KEYS (the global batch and the batch ramp) back to the checkpoint's.
    Returns the note to print, or None when nothing changed.
    """
    before = saved["config"]
    # keys a checkpoint does not record (written before they existed) are not compared
    changed = {key: (before[key], OmegaConf.select(cfg, key)) for key in SCHEDULE_KEYS
               if key in before and before[key] != OmegaConf.select(cfg, key)}
    if not changed:
        return None
    listed = ", ".join(f"{key} {old!r} → {new!r}" for key, (old, new) in changed.items())
    if cfg.train.reset_schedule:
        return f"resume: {listed}: train.reset_schedule=true: the new schedule applies from the step reached"
    for key in BATCH_KEYS:
        if key in changed:
            OmegaConf.update(cfg, key, before[key])
    kept = Schedule(**saved["resolved"])
    return (f"resume: {listed}: keeping the checkpoint's schedule (peak LR {kept.peak_lr:g}, warmup {kept.warmup_tokens:,} "
            f"tokens, cosine to {kept.min_lr_ratio:g}× by {kept.decay_tokens:,} tokens, global batch "
            f"{before['train.global_batch_size']}{_ramp_text(before)}); the run stops at train.max_steps={cfg.train.max_steps}. "
            f"Set train.reset_schedule=true to follow the new values instead")


def _ramp_text(config: dict) -> str:
    start = config.get("train.batch_ramp.start")
    if start is None:
        return ""
    return (f" reached by a ramp from {start} {config['train.batch_ramp.unit']} over "
            f"{config['train.batch_ramp.tokens']:,} tokens")


def schedule_for_run(cfg, model_name: str, run_tokens: int, run_dir: Path) -> RunSchedule:
    """The checkpoint's schedule when resuming one that records it (unless train.reset_schedule), else the
    configured one for a run of `run_tokens` tokens. The LR follows the tokens trained on
    (train/optimizer.py: TokenLR), which the checkpoint restores: a reset schedule applies at once from
    the tokens reached."""
    configured = make_schedule(cfg.optim, model_name, run_tokens)
    state = {"config": {key: OmegaConf.select(cfg, key) for key in SCHEDULE_KEYS},
             "resolved": dataclasses.asdict(configured)}
    found = checkpoint.saved_state(cfg.train.resume, run_dir)
    saved = recorded_schedule(found[1] if found is not None else None)
    if saved is None or cfg.train.reset_schedule:
        return RunSchedule(configured, state)
    return RunSchedule(Schedule(**saved["resolved"]), saved)
