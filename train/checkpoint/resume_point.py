"""Where a resume starts: the checkpoint train.resume names, chosen and verified once per run.

Every process of a run computes the same `ResumePoint` before anything is built (train/run/spec.py):
the newest intact checkpoint under the path train.resume names, each damaged one passed over reported in
one warning by rank 0, its state.json (checked against train/checkpoint/schema.py) read once. What the
run's checks compare (train/run/schedule.py, the data order) and what loading restores is that state,
so nothing of a checkpoint the run passed over is ever used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model import GPTConfig
from train.checkpoint import integrity, schema
from train.checkpoint.files import CheckpointError
from train.config.launch import is_rank_zero
from train.monitor import report

# How a resume refused for another model shape goes on: the same model, or a fresh start elsewhere or here
FRESH_START = ("resume with the same model settings; to train this model instead, start a new run: another run "
               "folder (hydra.run.dir=PATH), or train.resume=overwrite (moves the old run aside)")


@dataclass(frozen=True)
class ResumePoint:
    """Where a resume starts: `path` as train.resume names it (a checkpoints/ folder or one step
    folder), the checkpoint folder under it that the run loads (the newest intact one, verified) and
    its state.json (valid by train/checkpoint/schema.py)."""

    path: Path
    folder: Path
    state: dict


def resume_point(resume: str, run_dir: Path, model_cfg: GPTConfig) -> ResumePoint | None:
    """The checkpoint train.resume names for a run in `run_dir` (None: a fresh start): the newest
    intact one, verified here in this process, checked to hold this model. ValueError (a path with no
    checkpoint) or CheckpointError (none intact, or another model), each one line."""
    path = integrity.find_resume_path(resume, run_dir)
    if path is None:
        return None
    # every file but the shards' bytes, which loading hashes, shared by all ranks (train/checkpoint/loading.py)
    folder, state = integrity.select(path, warn=report.warner(is_rank_zero()), hash_shards=False)
    integrity.check_model(state["model"], model_cfg, folder, FRESH_START)
    missing = sorted(schema.RESUME_KEYS - set(state))
    if missing:
        raise CheckpointError(f"checkpoint {folder} holds weights but no run to resume (its state.json lacks "
                              f"{missing}); export it (python -m train.export) and start a new run from it "
                              f"with train.init_from")

    return ResumePoint(path, folder, state)
