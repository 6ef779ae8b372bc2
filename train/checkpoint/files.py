"""A checkpoint folder on disk: written whole or not at all, verified before a byte of it is used.

    checkpoints/
      latest                        the newest step's folder name, replaced atomically
      step00000008/
        manifest.json               every other file's size and sha256, the step and the layout
        state.json                  step, tokens, schedule, data position, model config, layout, …
        rng.json                    every rank's RNG states
        shard-00001-model-00001-of-00001.safetensors   one per rank that saved tensors
        …
      .tmp-step00000012/            a save in progress (or the leftover of an interrupted one)

A save writes into `.tmp-<step>`, fsyncs every file, writes the manifest last, fsyncs the folder,
renames it to `<step>` and only then replaces `latest`: a crash at any moment leaves the previous
checkpoints intact and at worst a `.tmp-*` folder, which the run removes when it starts again.

A folder is *intact* when its manifest parses, lists exactly the files present (no shard file
missing or extra), every size and sha256 matches, and every shard file's safetensors header
parses. Hashing is the expensive part; `digest_problems` checks any subset of the files, so ranks
can share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

MANIFEST, STATE, RNG, LATEST = "manifest.json", "state.json", "rng.json", "latest"
SHARD_SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
STEP_NAME = re.compile(r"step(\d{8,})")
_HASH_BLOCK = 1 << 24


class CheckpointError(ValueError):
    """A checkpoint that cannot be used or written; the message says which one and why."""


def checkpoint_dir(run_dir: Path) -> Path:
    """A run directory's checkpoints/ folder."""
    return Path(run_dir) / "checkpoints"


def step_tag(step: int) -> str:
    return f"step{step:08d}"


def step_of(folder: Path) -> int | None:
    match = STEP_NAME.fullmatch(Path(folder).name)
    return int(match[1]) if match else None


def step_folders(root: Path) -> list[Path]:
    """The step folders of a checkpoints/ folder, newest first."""
    if not Path(root).is_dir():
        return []
    found = [p for p in Path(root).iterdir() if (p.is_dir() or p.is_symlink()) and step_of(p) is not None]
    return sorted(found, key=step_of, reverse=True)


def remove(path: Path) -> None:
    """Delete a folder, a file or a symbolic link (the link only, never what it points to)."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def describe(path: Path) -> dict:
    """A manifest entry: {"bytes", "sha256"}."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256(path)}


def write_json(path: Path, value) -> None:
    """`value` as JSON, flushed to disk (inside a temporary folder: no rename needed)."""
    with open(path, "w") as f:
        f.write(json.dumps(value, indent=1, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json(path: Path):
    """JSON only: a checkpoint's plain data never goes through pickle."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary folder into place (an older folder of the same name, e.g. the
    step re-saved after resuming from an earlier checkpoint, or a symbolic link of that name, is replaced)."""
    fsync_dir(tmp)
    if final.exists() or final.is_symlink():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        if old.exists() or old.is_symlink():
            remove(old)
        os.replace(final, old)
        os.replace(tmp, final)
        remove(old)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def set_latest(root: Path, tag: str) -> None:
    """Point `latest` at `tag`: a temporary file renamed over it, never a half-written one."""
    tmp = root / f"{TMP_PREFIX}{LATEST}"
    with open(tmp, "w") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def read_latest(root: Path) -> tuple[str | None, str | None]:
    """(the step folder `latest` names, None) or (None, what is wrong with it)."""
    path = Path(root) / LATEST
    if not path.exists():
        return None, "is missing"
    try:
        tag = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None, "is not readable text"
    if not tag:
        return None, "is empty"
    if STEP_NAME.fullmatch(tag) is None:
        return None, f"does not name a step folder ({tag[:40]!r})"
    return tag, None


def remove_leftovers(root: Path) -> list[str]:
    """Remove what interrupted saves left behind (`.tmp-*`); returns their names."""
    if not Path(root).is_dir():
        return []
    removed = []
    for path in sorted(Path(root).glob(f"{TMP_PREFIX}*")):
        remove(path)
        removed.append(path.name)
    return removed


def prune(root: Path, keep: int, keep_every: int, saved: int) -> list[str]:
    """Delete step folders beyond the newest `keep` up to step `saved` (the one just saved), except
    steps that are multiples of `keep_every` (> 0); returns the names removed. Folders named for a later
    step (left by a run resumed from an earlier checkpoint, or misnamed) neither count nor go."""
    removed = []
    for folder in [f for f in step_folders(root) if step_of(f) <= saved][keep:]:
        if keep_every > 0 and step_of(folder) % keep_every == 0:
            continue
        remove(folder)
        removed.append(folder.name)
    return removed


def structure_problems(folder: Path) -> tuple[dict | None, list[str]]:
    """(manifest, problems) from the cheap checks: the folder is a real folder named for a step, its
    manifest is valid (train/checkpoint/schema.py) for that step and lists exactly the files present,
    each a regular file (no symbolic link) of the listed size. Hashes are `digest_problems`'."""
    from train.checkpoint.schema import manifest_problem

    folder = Path(folder)
    if folder.is_symlink():
        return None, [f"{folder.name} is a symbolic link; a checkpoint is a real folder (copy it, do not link it)"]
    if not folder.is_dir():
        return None, [f"{folder.name} is missing"]
    if step_of(folder) is None:
        return None, [f"{folder.name} is not named step<8 digits>, as a checkpoint's folder is"]
    path = folder / MANIFEST
    if path.is_symlink() or not path.is_file():
        return None, [f"no {MANIFEST} (an interrupted save, or not a gpt3d checkpoint)"]
    try:
        manifest = read_json(path)
    except (OSError, ValueError):
        return None, [f"{MANIFEST} is not a valid manifest (not JSON)"]
    problem = manifest_problem(manifest, step_of(folder))
    if problem:
        return None, [problem]
    files = manifest["files"]
    problems = []
    for name, entry in sorted(files.items()):
        file = folder / name
        if file.is_symlink():
            problems.append(f"{name} is a symbolic link, not a file of the checkpoint")
        elif not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != entry["bytes"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, the manifest says {entry['bytes']}")
    extra = sorted(p.name for p in folder.glob(f"*{SHARD_SUFFIX}") if p.name not in files)
    problems += [f"{name} is not in the manifest" for name in extra]
    for required in (STATE, RNG):
        if required not in files:
            problems.append(f"the manifest lists no {required}")
    return manifest, problems


def digest_problems(folder: Path, manifest: dict, names: list[str], hash_shards: bool = True) -> list[str]:
    """sha256 of each named file against the manifest (of shard files only when `hash_shards`: their
    bytes are the bulk of a checkpoint), and each shard file's safetensors header."""
    problems = []
    for name in names:
        file = Path(folder) / name
        try:
            if (hash_shards or not name.endswith(SHARD_SUFFIX)) and sha256(file) != manifest["files"][name]["sha256"]:
                problems.append(f"{name} does not match its checksum")
            elif name.endswith(SHARD_SUFFIX):
                _check_header(file)
        except OSError as err:
            problems.append(f"{name} cannot be read ({err.strerror})")
        except ValueError as err:
            problems.append(f"{name} is not a safetensors file ({err})")
    return problems


def _check_header(file: Path) -> None:
    """Parse a safetensors header (JSON) without reading tensor data."""
    from train.checkpoint.safetensors_header import read_header

    read_header(file)
