"""Checkpoints through DeepSpeed (model, optimizer, LR scheduler, ZeRO shards, at any layout)
plus our client state: step, tokens seen, data-stream position, RNG states and the model config.

DeepSpeed writes each checkpoint under <run dir>/checkpoints/<tag>/ and only then updates the
`latest` file, so an interrupted save never becomes the one a resume picks up. A resume loads
at the layout that saved; `read_model_weights` reads the model's weights alone at any layout
(generation), putting the shards back together with parallel/naming.py.
"""

from __future__ import annotations

import dataclasses
import random
import re
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


def save(engine, run_dir: Path, step: int, tokens: int, data_state: dict, model=None, extra: dict | None = None) -> Path:
    """Save a checkpoint of the engine and the loop's state after `step` optimizer steps (and the
    model config `model`, a GPTConfig, for whoever reads the weights later; `extra`: more client state)."""
    client_state = {"step": step, "tokens": tokens, "data": data_state, "rng": rng_state(), **(extra or {})}
    if model is not None:
        client_state["model"] = dataclasses.asdict(model)
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


def tag_folder(path: Path) -> Path:
    """The checkpoint folder `path` names: a run directory or its checkpoints/ folder (their latest
    checkpoint), or one step folder."""
    path = Path(path)
    for root in (path / "checkpoints", path):
        if (root / "latest").is_file():
            return root / (root / "latest").read_text().strip()
    if path.is_dir() and any(path.glob("*model_states.pt")):
        return path
    raise ValueError(
        f"{str(path)!r} holds no checkpoint: give a run directory, its checkpoints/ folder (with a 'latest' "
        f"file) or one step folder (with *model_states.pt files)"
    )


def saved_model_config(folder: Path) -> dict | None:
    """The model config a checkpoint folder was saved with (None for one saved without it)."""
    file = folder / "mp_rank_00_model_states.pt"
    return _load(file).get("model") if file.is_file() else None


def read_model_weights(folder: Path, config) -> dict[str, torch.Tensor]:
    """{full parameter name: tensor} of the whole model (parallel.naming's names) from a checkpoint
    folder written at any (tp, pp) layout with ZeRO stage 0–2, on the CPU as saved.

    A pipeline writes one file per (layer, tp rank), layer_<i>-model_<t>-model_states.pt, holding
    that layer's parameters; otherwise mp_rank_<t>_model_states.pt holds tp rank t's whole module.
    Each piece goes to its place in the full tensor by parallel.naming.layer_shards.
    """
    from parallel.naming import full_shapes, layer_shards, split_local_name

    pieces = []  # (layer, name within the layer, tp rank, tensor)
    for file in sorted(folder.glob("layer_*-model_states.pt")):
        match = re.fullmatch(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt", file.name)
        layer, tp_rank = int(match[1]), int(match[2] or 0)
        pieces += [(layer, name, tp_rank, tensor) for name, tensor in _load(file).items()]
    if not pieces:
        for file in sorted(folder.glob("mp_rank_*_model_states.pt")):
            tp_rank = int(re.fullmatch(r"mp_rank_(\d+)_model_states\.pt", file.name)[1])
            pieces += [(*split_local_name(name), tp_rank, tensor) for name, tensor in _load(file)["module"].items()]
    if not pieces:
        zero3 = any(folder.glob("zero_pp_rank_*_model_states.pt"))
        raise ValueError(f"checkpoint {folder} holds no model weights (no layer_*-model_states.pt or mp_rank_*_model_states.pt)"
                         + ("; a ZeRO-3 checkpoint keeps them partitioned (readable here: ZeRO stage 0–2)" if zero3 else ""))
    tp = 1 + max(piece[2] for piece in pieces)
    full = {}
    for layer, name, tp_rank, tensor in pieces:
        shard = layer_shards(config, layer, tp, tp_rank).get(name) if layer <= config.n_layer + 1 else None
        if shard is None or tuple(tensor.shape) != shard.local_shape:
            expected = "no such parameter" if shard is None else f"shape {shard.local_shape}"
            raise ValueError(
                f"checkpoint {folder}: layer {layer} {name} of shape {tuple(tensor.shape)} (tp rank {tp_rank} of {tp}) "
                f"does not fit the configured model ({expected}); use the model.* settings of the run that saved it"
            )
        if not shard.tied:
            full.setdefault(shard.name, torch.zeros(shard.full_shape, dtype=tensor.dtype))[shard.index] = tensor[shard.local_index]
    missing = sorted(set(full_shapes(config)) - set(full))
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {missing}")
    return full


def _load(file: Path):
    """A checkpoint file's tensors and plain values; nothing that would run code is unpickled."""
    return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
