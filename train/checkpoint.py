"""Checkpoints through DeepSpeed (model, optimizer, LR scheduler, ZeRO shards, at any layout)
plus our client state: step, tokens seen, data-stream position and RNG states.

DeepSpeed writes each checkpoint under <run dir>/checkpoints/<tag>/ and only then updates the
`latest` file, so an interrupted save never becomes the one a resume picks up.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_tag(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, run_dir: Path, step: int, tokens: int, data_state: dict) -> Path:
    """Save a checkpoint of the engine and the loop's state after `step` optimizer steps."""
    client_state = {"step": step, "tokens": tokens, "data": data_state, "rng": rng_state()}
    engine.save_checkpoint(str(checkpoint_dir(run_dir)), tag=step_tag(step), client_state=client_state)
    return checkpoint_dir(run_dir) / step_tag(step)


def find_resume_path(resume: str | None, run_dir: Path) -> Path | None:
    """train.resume: 'auto' → the run dir's latest checkpoint if any; 'none'/null → None; else a path."""
    if resume in (None, "none", "null", False):
        return None
    if resume == "auto":
        root = checkpoint_dir(run_dir)
        return root if (root / "latest").is_file() else None
    path = Path(resume)
    if not (path / "latest").is_file() and not path.parent.joinpath("latest").is_file():
        raise ValueError(
            f"train.resume={resume!r}: no DeepSpeed checkpoint there (expected a checkpoints/ folder with a "
            f"'latest' file, or one of its step folders); use auto, none, or such a path"
        )
    return path


def load(engine, path: Path) -> dict:
    """Load a checkpoint folder (its `latest` tag) or one tag folder; returns the client state."""
    path = Path(path)
    if (path / "latest").is_file():
        load_dir, tag = path, None
    else:
        load_dir, tag = path.parent, path.name
    loaded_path, client_state = engine.load_checkpoint(str(load_dir), tag=tag)
    if loaded_path is None:
        raise RuntimeError(f"DeepSpeed could not load a checkpoint from {path}")
    set_rng_state(client_state["rng"])
    return client_state
