"""What a resumed run may change: never the model's shape; its schedule only when asked to.

Every checkpoint records the model config (train/checkpoint/integrity.py refuses another model shape) and,
in its client state, the schedule the run trains with ("schedule", `RunSchedule.state`): the
configured SCHEDULE_KEYS and the LR schedule they resolved to (peak, warmup and decay in tokens,
floor). On resume, before anything is built:

- a schedule key that differs (a longer train.max_steps, another optim.lr, …) keeps the checkpoint's
  schedule: its resolved LR schedule and its batch (global batch size and batch ramp);
  train.max_steps still says where the run stops. With train.reset_schedule=true the new values apply instead, evaluated at the step the
  run has reached, as if it had used them from the start. Either way one note says which.

The schedule a run keeps is recorded again in its own checkpoints, so it stays the one the run
started with (or was last reset to), however often the run is resumed.

These functions only read: the batch settings a kept schedule brings back are returned
(`KeptSchedule.batch`), and train/run/spec.py makes new config sections with them. The
checkpoint is chosen and verified once per run, in every process alike (`resume_point`): the newest
intact one, each damaged one on the way reported in one warning (by rank 0:
train/checkpoint/resume_point.py). Its state.json, checked against train/checkpoint/schema.py, is what
these checks read and exactly what loading restores, so nothing of a checkpoint the run passed over is
ever used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from train.config.sections import Sections
from train.run.optimizer import Schedule, make_schedule

# What sets the batch each step trains on: a kept schedule keeps these as the checkpoint has them.
BATCH_KEYS = ("train.global_batch_size", "train.batch_ramp.start", "train.batch_ramp.unit",
              "train.batch_ramp.increment", "train.batch_ramp.tokens")
SCHEDULE_KEYS = ("train.max_steps", *BATCH_KEYS, "optim.lr", "optim.warmup_tokens", "optim.decay_tokens",
                 "optim.min_lr_ratio")


@dataclass(frozen=True)
class KeptSchedule:
    """What comparing the configured schedule with a checkpoint's gives: the note to print (None:
    nothing changed), the batch settings to take back ({dotted key: the checkpoint's value}) and the
    LR schedule to keep (None: the configured one applies)."""

    note: str | None = None
    batch: dict = dataclasses.field(default_factory=dict)
    lr: Schedule | None = None


@dataclass(frozen=True)
class RunSchedule:
    schedule: Schedule  # the LR schedule this run follows
    state: dict  # what its checkpoints record: {"config": {key: value}, "resolved": Schedule's fields}


def recorded_schedule(state: dict | None) -> dict | None:
    """The schedule a checkpoint's state.json records (the `schedule` entry of its client state), or
    None (no checkpoint, or one that records none)."""
    extra = state.get("extra") if state is not None else None
    return extra.get("schedule") if isinstance(extra, dict) else None


def kept_schedule(saved: dict | None, sections: Sections) -> KeptSchedule:
    """Compare the configured schedule (the run's config sections, train/config/sections/) with `saved`,
    the one a checkpoint records (see the module docstring; the model's shape is checked by `resume_point`)."""
    if saved is None:
        return KeptSchedule()
    before = saved["config"]
    # keys a checkpoint does not record (written before they existed) are not compared
    changed = {key: (before[key], sections.value(key)) for key in SCHEDULE_KEYS
               if key in before and before[key] != sections.value(key)}
    if sections.train.reset_schedule:
        if not changed:
            return KeptSchedule()
        return KeptSchedule(f"resume: {_listed(changed)}: train.reset_schedule=true: the new schedule applies from the "
                            f"step reached")
    kept = Schedule(**saved["resolved"])
    if not changed:
        return KeptSchedule(lr=kept)
    note = (f"resume: {_listed(changed)}: keeping the checkpoint's schedule (peak LR {kept.peak_lr:g}, warmup "
            f"{kept.warmup_tokens:,} tokens, cosine to {kept.min_lr_ratio:g}× by {kept.decay_tokens:,} tokens, global "
            f"batch {before['train.global_batch_size']}{_ramp_text(before)}); the run stops at "
            f"train.max_steps={sections.train.max_steps}. Set train.reset_schedule=true to follow the new values instead")
    return KeptSchedule(note, {key: before[key] for key in BATCH_KEYS if key in changed}, kept)


def _listed(changed: dict) -> str:
    return ", ".join(f"{key} {old!r} → {new!r}" for key, (old, new) in changed.items())


def _ramp_text(config: dict) -> str:
    start = config.get("train.batch_ramp.start")
    if start is None:
        return ""
    return (f" reached by a ramp from {start} {config['train.batch_ramp.unit']} over "
            f"{config['train.batch_ramp.tokens']:,} tokens")


def schedule_for_run(sections: Sections, model_name: str, run_tokens: int, kept: KeptSchedule, saved: dict | None,
                     warmup_set: bool = False) -> RunSchedule:
    """The checkpoint's schedule when the resume keeps it (`kept.lr`; `saved` is what the checkpoint
    records), else the configured one for a run of `run_tokens` tokens (ValueError if none can be
    built; `warmup_set`: the user set optim.warmup_tokens, train/run/optimizer.py: make_schedule). The LR
    follows the tokens trained on (train/run/optimizer.py: TokenLR), which the checkpoint restores: a reset
    schedule applies at once from the tokens reached."""
    configured = make_schedule(sections.optim, model_name, run_tokens, warmup_set)
    if kept.lr is not None:
        return RunSchedule(kept.lr, saved)
    state = {"config": {key: sections.value(key) for key in SCHEDULE_KEYS},
             "resolved": dataclasses.asdict(configured)}
    return RunSchedule(configured, state)
