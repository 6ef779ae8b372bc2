"""The run folder: usable, and never shared by two runs.

A run folder (Hydra's run directory) holds one run: its checkpoints, metrics.jsonl, W&B files and plan.
A run that starts afresh (train.resume=none, or train.resume=auto finding no checkpoint, or a resume from
a checkpoint in another folder) in a folder that already holds checkpoints would write its steps beside
the old ones, and the next `train.resume=auto` would pick up whichever is newest. So such a start is
refused with one line naming the choices: resume it (train.resume=auto), another folder
(hydra.run.dir=...), or `train.resume=overwrite`, which moves everything of the old run (all but Hydra's
.hydra record of this launch and its log files) into a sibling folder ``<name>.replaced-<UTC time>``
and then starts afresh. A folder that cannot be a folder (a path through a file, no write permission) is
refused too. `check_run_folder` only looks; `set_aside` (rank 0, after every check passed) moves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from train.checkpoint import checkpoint_dir, find_resume_path
from train.config.command_line import check_usable
from train.config.sections.train import OVERWRITE
from train.config.settings import ConfigError

KEPT = (".hydra",)  # Hydra's record of this very launch, written before any check


@dataclass(frozen=True)
class RunFolder:
    path: Path
    set_aside_to: Path | None  # train.resume=overwrite on a used folder: where the old run goes


def check_run_folder(run_dir: Path, resume, resume_path: Path | None) -> RunFolder:
    """Refuse a run folder that cannot be used, or that holds another run's checkpoints when this run does not
    continue them (`resume_path`: the checkpoint this run resumes from, or None). Raises ConfigError."""
    run_dir = Path(run_dir)
    check_usable(run_dir)
    old = _old_run(run_dir)
    if resume == OVERWRITE:
        return RunFolder(run_dir, _aside_name(run_dir) if old else None)
    continues_here = resume_path is not None and _inside(resume_path, checkpoint_dir(run_dir))
    if continues_here or find_resume_path("auto", run_dir) is None:
        return RunFolder(run_dir, None)
    start = "resumes from another folder's checkpoint" if resume_path is not None else f"starts afresh (train.resume={resume})"
    raise ConfigError(
        f"run folder {run_dir} already holds a run's checkpoints and this run {start}; resume it with train.resume=auto, "
        f"choose a new folder with hydra.run.dir=PATH, or set train.resume={OVERWRITE} to move the old run aside "
        f"(to {run_dir.name}.replaced-<time>)"
    )


def set_aside(folder: RunFolder) -> None:
    """Move the old run's files (all but KEPT and log files) into folder.set_aside_to; say so on stdout."""
    if folder.set_aside_to is None:
        return
    folder.set_aside_to.mkdir()
    for entry in _old_run(folder.path):
        entry.rename(folder.set_aside_to / entry.name)
    print(f"gpt3d: train.resume={OVERWRITE}: the previous run in {folder.path} was moved to {folder.set_aside_to}",
          flush=True)


def _old_run(run_dir: Path) -> list[Path]:
    """What an earlier run left in `run_dir`: every entry but KEPT and log files."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.name not in KEPT and p.suffix != ".log")


def _aside_name(run_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside, n = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}"), 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}")
    return aside


def _inside(path: Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(folder).resolve())
