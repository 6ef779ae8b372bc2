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
checkpoints intact and at worst a `.tmp-*` folder, which the next save or resume removes.

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


def step_tag(step: int) -> str:
    return f"step{step:08d}"


def step_of(folder: Path) -> int | None:
    match = STEP_NAME.fullmatch(Path(folder).name)
    return int(match[1]) if match else None


def step_folders(root: Path) -> list[Path]:
    """The step folders of a checkpoints/ folder, newest first."""
    if not Path(root).is_dir():
        return []
    found = [p for p in Path(root).iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of, reverse=True)


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
    step re-saved after resuming from an earlier checkpoint, is replaced)."""
    fsync_dir(tmp)
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
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
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        removed.append(path.name)
    return removed


def prune(root: Path, keep: int, keep_every: int) -> list[str]:
    """Delete step folders beyond the newest `keep`, except steps that are multiples of `keep_every`
    (> 0); returns the names removed."""
    removed = []
    for folder in step_folders(root)[keep:]:
        if keep_every > 0 and step_of(folder) % keep_every == 0:
            continue
        shutil.rmtree(folder)
        removed.append(folder.name)
    return removed


def structure_problems(folder: Path) -> tuple[dict | None, list[str]]:
    """(manifest, problems) from the cheap checks: the manifest parses and lists exactly the files
    present, with their sizes. Hashes are `digest_problems`'."""
    folder = Path(folder)
    if not folder.is_dir():
        return None, [f"{folder.name} is missing"]
    path = folder / MANIFEST
    if not path.is_file():
        return None, [f"no {MANIFEST} (an interrupted save, or not a gpt3d checkpoint)"]
    try:
        manifest = read_json(path)
        files = manifest["files"]
        if not isinstance(files, dict) or not all(isinstance(e, dict) and "bytes" in e and "sha256" in e
                                                  for e in files.values()):
            raise ValueError
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None, [f"{MANIFEST} is not a valid manifest"]
    problems = []
    for name, entry in sorted(files.items()):
        file = folder / name
        if Path(name).name != name or not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != entry["bytes"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, the manifest says {entry['bytes']}")
    extra = sorted(p.name for p in folder.glob(f"*{SHARD_SUFFIX}") if p.name not in files)
    problems += [f"{name} is not in the manifest" for name in extra]
    for required in (STATE, RNG):
        if required not in files:
            problems.append(f"the manifest lists no {required}")
    return manifest, problems


def digest_problems(folder: Path, manifest: dict, names: list[str]) -> list[str]:
    """sha256 of each named file against the manifest, and each shard file's safetensors header."""
    problems = []
    for name in names:
        file = Path(folder) / name
        try:
            if sha256(file) != manifest["files"][name]["sha256"]:
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
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            f.keys()
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise ValueError(str(err).splitlines()[0][:120]) from None
