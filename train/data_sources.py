"""Where training text comes from: the `data` config, checked cheaply, and a resumable document stream.

Three sources, all read with Hugging Face `datasets` in streaming mode:

- ``stdlib``: the running Python's standard-library ``.py`` files, one document per file (no setup);
- ``files``: local files or globs, ``.txt`` (one document per file), ``.jsonl``/``.json`` or
  ``.parquet`` (one document per record, its ``text_field``);
- ``hub``: a dataset streamed from the Hugging Face Hub (``name``, ``config_name``, ``split``).

`documents()` yields each document as tokens with a JSON-able cursor saying where it starts, built on
`datasets`' own `IterableDataset.state_dict()`, so a stream can be reopened mid-way without
re-reading what came before.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import sysconfig
import zlib
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlparse

import numpy as np

from train.tokenizer import EOT, gpt2

SOURCES = ("stdlib", "files", "hub")
KEYS = ("source", "paths", "name", "config_name", "split", "text_field", "shuffle_buffer", "val_permille")
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # extension → datasets builder
HUB_ENDPOINT = "https://huggingface.co"


class DataError(ValueError):
    """A data configuration that cannot work, found before any heavy work."""


@dataclass(frozen=True)
class DataSpec:
    """A checked `data` config: the source with its files resolved, plus the split and shuffle knobs."""

    source: str
    files: tuple[str, ...]  # every document file (files: sorted; stdlib: scrambled, see _stdlib_files); hub: empty
    builder: str  # the datasets builder ("text", "json", "parquet") or, for hub, the dataset name
    config_name: str | None  # hub only
    split: str  # hub: the split streamed; local files are all one "train" split
    text_field: str
    shuffle_buffer: int
    val_permille: int

    @property
    def field(self) -> str:
        """The record field holding a document's text (the text builder always calls it "text")."""
        return "text" if self.source != "hub" and self.builder == "text" else self.text_field

    def fingerprint(self) -> dict:
        """What fixes the document stream; a resume state must come from a stream with the same one."""
        names = "\n".join(os.path.basename(f) for f in self.files)
        return {
            "source": self.source,
            "builder": self.builder,
            "config_name": self.config_name,
            "split": self.split,
            "text_field": self.text_field,
            "files": len(self.files),
            "files_crc32": zlib.crc32(names.encode()),
            "shuffle_buffer": self.shuffle_buffer,
            "val_permille": self.val_permille,
        }


def check_data_config(data_cfg) -> None:
    """Raise DataError if `data_cfg` cannot work: unknown source or key, missing file, empty glob,
    unsupported or mixed extensions, missing text field, unreachable Hub. Cheap: reads no documents."""
    resolve(data_cfg)


def resolve(data_cfg) -> DataSpec:
    """Check `data_cfg` (a dict or omegaconf DictConfig) and resolve its files."""
    cfg = _as_dict(data_cfg)
    unknown = sorted(set(cfg) - set(KEYS))
    if unknown:
        raise DataError(f"data: unknown key(s) {unknown}; valid keys: {list(KEYS)}")
    source = cfg.get("source", "stdlib")
    if source not in SOURCES:
        raise DataError(f"data.source={source!r} is not one of {list(SOURCES)}")
    text_field = cfg.get("text_field") or "text"
    shuffle_buffer, val_permille = cfg.get("shuffle_buffer", 1024), cfg.get("val_permille", 5)
    if not isinstance(shuffle_buffer, int) or shuffle_buffer < 1:
        raise DataError(f"data.shuffle_buffer={shuffle_buffer!r} must be a whole number of windows >= 1")
    if not isinstance(val_permille, int) or not 0 <= val_permille < 1000:
        raise DataError(f"data.val_permille={val_permille!r} must be a whole number in [0, 1000)")
    knobs = dict(text_field=text_field, shuffle_buffer=shuffle_buffer, val_permille=val_permille)
    if source == "stdlib":
        return DataSpec("stdlib", _stdlib_files(), "text", None, "train", **knobs)
    if source == "files":
        files = _expand(cfg.get("paths"))
        builder = _builder_of(files)
        _check_text_field(files[0], builder, text_field)
        return DataSpec("files", files, builder, None, "train", **knobs)
    name = cfg.get("name")
    if not name:
        raise DataError("data.source=hub needs data.name, a Hugging Face Hub dataset, e.g. HuggingFaceFW/fineweb")
    _check_hub_reachable(name)
    return DataSpec("hub", (), name, cfg.get("config_name"), cfg.get("split") or "train", **knobs)


def _as_dict(data_cfg) -> dict:
    """A plain dict of the set values (omegaconf's '???' placeholders dropped)."""
    if data_cfg is None:
        return {}
    if not isinstance(data_cfg, dict):
        from omegaconf import OmegaConf

        data_cfg = OmegaConf.to_container(data_cfg, resolve=True)
    return {k: v for k, v in data_cfg.items() if v != "???"}


def _stdlib_files() -> tuple[str, ...]:
    """Every .py file of the running Python's standard library (installed packages excluded), in a fixed
    scrambled order (by crc32 of the path), so that one package's or test folder's files don't arrive
    as one long run, which a shuffle buffer of a few hundred windows cannot break up."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda path: (zlib.crc32(os.path.relpath(path, root).encode()), path))
    if not files:
        raise DataError(f"data.source=stdlib: no .py files under {root}; use data=files")
    return tuple(files)


def _expand(paths) -> tuple[str, ...]:
    """Resolve data.paths (a path, glob or list of them) to the sorted files they name."""
    if not paths:
        raise DataError("data.source=files needs data.paths, e.g. data.paths=[/data/corpus/*.jsonl]")
    if isinstance(paths, str):
        paths = [paths]
    files, missing = set(), []
    for pattern in paths:
        pattern = os.path.expanduser(str(pattern))
        if any(c in pattern for c in "*?["):
            matched = [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
            if not matched:
                missing.append(f"glob {pattern!r} matches no files")
            files.update(os.path.abspath(f) for f in matched)
        elif os.path.isfile(pattern):
            files.add(os.path.abspath(pattern))
        elif os.path.isdir(pattern):
            missing.append(f"{pattern!r} is a directory (name its files, e.g. {os.path.join(pattern, '*.txt')!r})")
        else:
            missing.append(f"no such file {pattern!r}")
    if missing:
        raise DataError("data.paths: " + "; ".join(missing))
    return tuple(sorted(files))


def _builder_of(files: tuple[str, ...]) -> str:
    """The one datasets builder that reads every file, from their extensions."""
    valid = ", ".join(BUILDERS)
    unknown = sorted({os.path.splitext(f)[1] or "(none)" for f in files} - set(BUILDERS))
    if unknown:
        raise DataError(f"data.paths: unsupported extension(s) {unknown}; valid: {valid}")
    builders = {BUILDERS[os.path.splitext(f)[1]] for f in files}
    if len(builders) > 1:
        kinds = sorted({os.path.splitext(f)[1] for f in files})
        raise DataError(f"data.paths mixes file kinds {kinds}; use one kind per run ({valid}; .json and .jsonl mix)")
    return builders.pop()


def _check_text_field(first_file: str, builder: str, text_field: str) -> None:
    """For record files, check that the first file's records carry `text_field` (schema or first line only)."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        fields = pq.read_schema(first_file).names
    elif first_file.endswith(".jsonl"):
        with open(first_file, encoding="utf-8") as f:
            line = f.readline()
        try:
            fields = list(json.loads(line)) if line.strip() else [text_field]
        except (json.JSONDecodeError, TypeError) as e:
            raise DataError(f"data.paths: {first_file} does not start with a JSON object per line ({e})") from None
    else:
        return
    if text_field not in fields:
        raise DataError(f"data.text_field={text_field!r} is not a field of {first_file}; its fields: {fields}")


def hub_offline() -> bool:
    """Whether Hugging Face offline mode is switched on, read from the environment now."""
    flag = os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE")
    if flag is not None:
        return flag.strip().upper() in {"1", "ON", "YES", "TRUE"}
    import datasets

    return bool(datasets.config.HF_HUB_OFFLINE)


def _check_hub_reachable(name: str) -> None:
    """Fail fast, with advice, when the Hub cannot be reached (offline mode, no network): one TCP connect."""
    advice = (
        f"data.source=hub needs the Hugging Face Hub to stream {name!r}, but this machine cannot reach it ({{why}}). "
        "Train on local files instead: data=files 'data.paths=[/path/to/*.jsonl]' (or data=stdlib)."
    )
    if hub_offline():
        raise DataError(advice.format(why="offline mode: HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set"))
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # behind a proxy a direct connection proves nothing; loading reports any failure
    url = urlparse(os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=5).close()
    except OSError as e:
        raise DataError(advice.format(why=f"{url.hostname}:{port}: {e}")) from None


def open_stream(spec: DataSpec):
    """The spec's documents as a streaming `datasets.IterableDataset`, in a fixed order."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if spec.source == "hub":
        try:
            return datasets.load_dataset(spec.builder, spec.config_name, split=spec.split, streaming=True)
        except (ConnectionError, OSError) as e:
            raise DataError(f"data.source=hub: cannot stream {spec.builder!r} ({e}); use data=files") from e
    options = {"sample_by": "document", "encoding_errors": "replace"} if spec.builder == "text" else {}
    return datasets.load_dataset(spec.builder, data_files=list(spec.files), split="train", streaming=True, **options)


def is_validation(text: str, val_permille: int) -> bool:
    """The held-out split, per document by a stable hash of its text (so independent of order)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % 1000 < val_permille


def documents(spec: DataSpec, validation: bool, cursor: dict | None = None, repeat: bool = False) -> Iterator:
    """Yield (cursor, tokens) for each document of one split, from `cursor` on (None: the start).

    tokens: int32 array, the document's GPT-2 tokens then `<|endoftext|>`, from the cursor's token offset.
    cursor: {"epoch", "docs": the datasets state just before the document (None at an epoch's start),
    "offset": tokens of the document already used}; plain ints/strings, fit for a checkpoint.
    repeat: after the last document start the next epoch (the same documents again), forever.
    """
    enc = gpt2()
    cursor = cursor or {"epoch": 0, "docs": None, "offset": 0}
    epoch, before, offset = cursor["epoch"], cursor["docs"], cursor["offset"]
    while True:
        stream = open_stream(spec)
        if before is not None:
            stream.load_state_dict(before)
        fresh, kept = before is None, 0
        for record in stream:
            after = stream.state_dict()
            text = _text_of(record, spec.field)
            if is_validation(text, spec.val_permille) == validation:
                ids = enc.encode_ordinary(text)
                ids.append(EOT)
                kept += 1
                yield {"epoch": epoch, "docs": before, "offset": offset}, np.array(ids[offset:], dtype=np.int32)
            before, offset = after, 0
        if not repeat:
            return
        if fresh and kept == 0:
            split = "validation" if validation else "training"
            raise DataError(f"data.source={spec.source} has no {split} documents (val_permille={spec.val_permille})")
        epoch, before = epoch + 1, None


def _text_of(record: dict, text_field: str) -> str:
    """The document text of one record, or a clear error."""
    text = record.get(text_field)
    if not isinstance(text, str):
        raise DataError(
            f"data.text_field={text_field!r}: a record holds {type(text).__name__} there, not text; "
            f"its fields: {list(record)}"
        )
    return text
