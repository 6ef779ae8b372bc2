"""Which checkpoint a run may use: found where train.resume points, verified before a value is read.

`verify` is the one check of one step folder: its structure (train/checkpoint/files.py), the
checksums of its files, what state.json and rng.json hold (train/checkpoint/schema.py) and the
tensors the shard headers describe, each present, fp32 and tiled exactly once. Two choices say how
it hashes: `hash_shards=False` leaves out the shard files' bytes (the bulk of a checkpoint), as the
checks before the build do, which run in every process; `shared=True` spreads the hashing over the
ranks of the default process group (each hashes every world-th file; every rank gets the same
answer), as loading does. `file_problems` is its first half alone, the structure and the checksums:
loading checks the shards of a folder whose content was checked before the build with it. `select`
chooses the newest folder `verify` finds intact, reporting each one passed over in one warning, and
`check_model` refuses a checkpoint of another model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from train.checkpoint import files, schema
from train.checkpoint.files import CheckpointError, checkpoint_dir
from train.checkpoint.optimizer_state import KINDS
from train.monitor import report

if TYPE_CHECKING:
    from model import GPTConfig

# Model config keys that do not change what the weights mean: a checkpoint need not match them.
RUN_ONLY_KEYS = ("name", "attention_impl", "deterministic_attention", "compile", "dropout", "init_std")

def find_resume_path(resume, run_dir: Path) -> Path | None:
    """train.resume: 'auto' → the run dir's checkpoints/ folder when it holds any checkpoint (or a
    `latest`), else None (a fresh start); 'none'/null → None; else a path: a run directory, its
    checkpoints/ folder, or one step folder. Cheap: nothing is verified yet (`select` does that)."""
    if resume in (None, "none", "null", False):
        return None
    if resume == "auto":
        root = checkpoint_dir(run_dir)
        return root if holds_checkpoints(root) else None
    path = Path(str(resume))
    for candidate in (path, checkpoint_dir(path)):
        if is_step_folder(candidate) or holds_checkpoints(candidate):
            return candidate
    raise ValueError(
        f"train.resume={resume!r}: no gpt3d checkpoint there (expected a run directory, its checkpoints/ folder, "
        f"or one step folder holding {files.MANIFEST}); use auto, none, overwrite, or such a path"
    )


def holds_checkpoints(root: Path) -> bool:
    """Whether `root` is a checkpoints/ folder: step folders in it, or a `latest`."""
    return bool(files.step_folders(root)) or (Path(root) / files.LATEST).exists()


def is_step_folder(path: Path) -> bool:
    return path.is_dir() and ((path / files.MANIFEST).exists() or files.step_of(path) is not None)


def tag_folder(path: Path) -> Path:
    """The intact checkpoint folder `path` names (one process, every file hashed): a run directory or its
    checkpoints/ folder (the newest intact one), or one step folder. ValueError if there is none."""
    path = Path(path)
    for root in (checkpoint_dir(path), path):
        if holds_checkpoints(root) or is_step_folder(root):
            return select(root)[0]
    raise ValueError(
        f"{str(path)!r} holds no checkpoint: give a run directory, its checkpoints/ folder or one step folder "
        f"(with {files.MANIFEST})"
    )


def select(path: Path, *, warn: Callable[[str], None] | None = None, before: Path | None = None,
           hash_shards: bool = True, shared: bool = False) -> tuple[Path, dict]:
    """(the checkpoint folder to use, its state.json as `verify` read it): `path` itself if it is a step
    folder, else the newest intact step folder under it (older than the step folder `before`, if given:
    one found damaged already). Each damaged or incomplete one on the way is reported in one line
    (`warn`, by default `report.warn`); none intact is a CheckpointError. `hash_shards`, `shared`: how
    `verify` hashes."""
    warn = warn or report.warn
    path = Path(path)
    if is_step_folder(path) and not holds_checkpoints(path):
        problems, state = verify(path, hash_shards=hash_shards, shared=shared)
        if problems:
            raise damaged(path, problems)
        return path, state
    candidates, missing = _candidates(path, warn, before)
    rejected = []
    for folder in candidates:
        problems, state = verify(folder, hash_shards=hash_shards, shared=shared)
        if not problems:
            return folder, state
        rejected.append(f"{folder.name}: {'; '.join(problems)}")
        warn(passed_over(folder, problems))
    raise CheckpointError(
        f"no intact checkpoint in {path} ({'; '.join(rejected) or 'no step folders'}{missing}); move the damaged "
        f"ones away, resume from another path (train.resume=<path>), or start a new run (train.resume=none or "
        f"another run directory)"
    )


def damaged(folder: Path, problems: list[str]) -> CheckpointError:
    """The error for a checkpoint that was asked for and is not intact."""
    return CheckpointError(f"checkpoint {folder} is damaged or incomplete: {'; '.join(problems)}")


def passed_over(folder: Path, problems: list[str]) -> str:
    """The warning for a checkpoint that is not intact, where the previous one is tried next."""
    return f"checkpoint {folder} is damaged or incomplete ({'; '.join(problems)}); trying the previous one"


def _candidates(root: Path, warn, before: Path | None) -> tuple[list[Path], str]:
    """(the step folders of `root` to try, newest first; what to add to the error when none is intact).
    A `latest` that is unreadable or names a missing folder is reported, never taken for "no checkpoint";
    with `before`, `latest` was looked at when `before` was chosen."""
    candidates = files.step_folders(root)
    if before is not None:
        return [f for f in candidates if files.step_of(f) < files.step_of(before)], ""
    latest, latest_problem = files.read_latest(root)
    dangling = latest is not None and not (root / latest).is_dir()
    if latest_problem and candidates:
        warn(f"{root / files.LATEST} {latest_problem}; looking for the newest intact checkpoint in {root}")
    elif dangling and candidates:
        warn(f"{root / files.LATEST} names {latest}, which is missing; looking for the newest intact checkpoint")
    return candidates, f"; {files.LATEST} names {latest}, which is missing" if dangling else ""


def verify(folder: Path, *, hash_shards: bool = True, shared: bool = False) -> tuple[list[str], dict | None]:
    """(problems, state.json when there are none) of one step folder: its files (`file_problems`), then
    what they say (`_content_problems`)."""
    manifest, problems = file_problems(folder, hash_shards=hash_shards, shared=shared)
    return (problems, None) if problems else _content_problems(folder, manifest)


def file_problems(folder: Path, *, hash_shards: bool = True, shared: bool = False) -> tuple[dict | None, list[str]]:
    """(manifest, problems) of one step folder's files: its structure (files.structure_problems) and the
    checksums of its files (of the shard files only with `hash_shards`), each rank hashing every world-th
    file when `shared` (a collective every rank calls, which every rank leaves with the same problems)."""
    manifest, problems = files.structure_problems(folder)
    names = [] if problems else sorted(manifest["files"])
    digests = _shared_digest_problems if shared else files.digest_problems
    hashed = digests(folder, manifest, names, hash_shards)  # every rank, when shared: even with problems found
    return manifest, problems or hashed


def _shared_digest_problems(folder: Path, manifest: dict, names: list[str], hash_shards: bool) -> list[str]:
    """`files.digest_problems` of `names`, each rank hashing every world-th one; every rank returns the
    same problems."""
    import torch.distributed as dist

    mine = files.digest_problems(folder, manifest, names[dist.get_rank()::dist.get_world_size()], hash_shards)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return sorted({p for ps in gathered for p in ps})


def _content_problems(folder: Path, manifest: dict) -> tuple[list[str], dict | None]:
    """(problems, state.json when there are none) of what an intact folder's files say
    (train/checkpoint/schema.py): state.json and rng.json, and the tensors of the model state.json
    describes, from the shard headers (each present, fp32, its chunks tiling it exactly once). Cheap:
    no tensor data is read."""
    from model import GPTConfig

    try:
        state = files.read_json(folder / files.STATE)
        rng = files.read_json(folder / files.RNG)
    except (OSError, ValueError):
        return ["state.json or rng.json is not valid JSON"], None
    problem = (schema.state_problem(state, files.step_of(folder))
               or schema.rng_problem(rng, torch.get_rng_state().numel()))
    if problem:
        return [problem], None
    try:
        model_cfg = GPTConfig(**state["model"])  # its keys are GPTConfig's fields (schema)
    except (TypeError, ValueError) as err:
        return [f"state.json: model describes no valid model ({err})"], None
    shard_files = sorted(name for name in manifest["files"] if name.endswith(files.SHARD_SUFFIX))
    from train.checkpoint import tensors  # deferred: see train/checkpoint/tensors.py

    problems = tensors.layout_problems(folder, shard_files, saved_shapes(model_cfg))
    return ([f"tensors: {'; '.join(problems[:3])}"], None) if problems else ([], state)


def saved_shapes(model_cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """{saved tensor name: full shape} of a checkpoint of this model."""
    from parallel.naming import full_shapes

    return {f"{kind}/{name}": shape for name, shape in full_shapes(model_cfg).items() for kind in KINDS}


def checked_state(folder: Path) -> dict:
    """state.json of a checkpoint folder that `select` chose (so verified), checked again against the
    schema as it is read; CheckpointError naming the field otherwise."""
    try:
        state = files.read_json(Path(folder) / files.STATE)
    except (OSError, ValueError):
        raise CheckpointError(f"{Path(folder) / files.STATE} is not valid JSON") from None
    problem = schema.state_problem(state, files.step_of(folder))
    if problem:
        raise CheckpointError(f"checkpoint {folder}: {problem}")
    return state


def check_model(saved: dict, model_cfg: GPTConfig, folder: Path,
                advice: str = "resume with the same model settings, or start a new run") -> None:
    """One error naming every model setting that differs from the checkpoint's, then `advice`."""
    differing = model_differences(saved, model_cfg)
    if differing:
        raise CheckpointError(
            f"checkpoint {folder} holds another model: it was saved with "
            + ", ".join(f"model.{k}={saved.get(k)!r} (now {getattr(model_cfg, k, None)!r})" for k in differing)
            + f"; {advice}"
        )


def model_differences(saved: dict, model_cfg: GPTConfig) -> list[str]:
    """Model config keys whose saved value differs from `model_cfg`'s (run-only keys aside)."""
    current = dataclasses.asdict(model_cfg)
    keys = (set(saved) | set(current)) - set(RUN_ONLY_KEYS)
    return sorted(k for k in keys if saved.get(k) != current.get(k))
