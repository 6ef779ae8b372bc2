"""The `data` config, checked cheaply: which documents a run reads and how its pipeline is shaped.

Six kinds of source (``data.source``):

- ``stdlib``: the running Python's standard-library ``.py`` files, one document per file (no setup);
- ``docstrings``: the English prose of the same files' docstrings (train/data/docstrings.py), test
  packages left out, one document per file (no setup): the quickstart's corpus;
- ``files``: local files or globs, ``.txt`` (one document per file), ``.jsonl``/``.json`` or
  ``.parquet`` (one document per record, its ``text_field``);
- ``hub``: a dataset streamed by `datasets` (``name``, ``config_name``, ``split``): ``name`` is what
  ``datasets.load_dataset`` takes: a Hub dataset, a local dataset folder, or, with offline mode on
  (``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``), a dataset in the local datasets cache;
- ``prepared``: a folder written by ``python -m train.prepare_data`` (`datasets`' save_to_disk);
- ``mixture``: a weighted list of sources of the kinds above (``sources``, each with a ``weight``).

Pipeline keys (top level only): ``streams`` (documents are dealt to this many streams by their index
modulo it; global batches are assembled stream by stream), ``shuffle_buffer`` (windows shuffled
together, over all streams), ``workers`` / ``prefetch`` (background packing), ``on_bad_record``,
``read_retries`` / ``read_retry_s`` / ``read_timeout_s`` (a file or Hub request that cannot be read, tried again:
train/data/reading.py).
Record keys (top level, or per mixture entry): ``text_field``, ``encoding``, ``val_permille``,
``piece_chars`` (a ``.txt`` document longer than this is cut into pieces: train/data/pieces.py).

Every key's type, default and check live with its section (train/config/sections/data.py); `resolve()`
reads the built section (a plain mapping is built into one first) and turns it into a frozen `DataSpec`,
raising `DataError` naming the bad value or file.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import json
import os
import socket
import sysconfig
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from train.config.sections.data import (
    ENCODING,
    KIND_KEYS,
    NOT_SET,
    PIECE_CHARS,
    RECORD_KEYS,
    SOURCES,
    TEXT_FIELD,
    VAL_PERMILLE,
    DataConfig,
    HubData,
    data_section,
)
from train.config.sections.data import (
    KINDS as SCHEMAS,
)
from train.config.settings import ConfigError

KINDS = SOURCES[:-1]  # what a single source (or a mixture entry) can be: every source but "mixture"
ENTRY_KEYS = ("label", "weight", "source", *RECORD_KEYS, *(k for kind in KINDS for k in KIND_KEYS[kind]))
ENTRY_CHECKS = {"encoding": ENCODING, "val_permille": VAL_PERMILLE, "piece_chars": PIECE_CHARS, "text_field": TEXT_FIELD}
TEST_FOLDERS = ("test", "tests", "idle_test")  # the standard library's test packages (data=docstrings leaves them out)
READERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # extension → reader
PREPARED_MARK = "gpt3d-prepared"  # in the description of a prepared dataset's splits
HUB_ENDPOINT = "https://huggingface.co"
NO_BAD_RECORDS = "skip"  # data=prepared: already tokenized, nothing can be a bad record


class DataError(ValueError):
    """A data configuration or corpus that cannot work; the message names the value or file."""


@dataclass(frozen=True)
class SourceSpec:
    """One checked source of documents."""

    kind: str  # stdlib | docstrings | files | hub | prepared
    label: str  # how messages and shares name it (a mixture entry's label, else the kind)
    reader: str  # text (a document per file) | docstrings (a file's docstring prose) | json | parquet | hub | prepared
    files: tuple[str, ...] = ()  # stdlib/docstrings/files: every document file, in reading order
    name: str | None = None  # hub: the dataset
    config_name: str | None = None
    split: str = "train"
    path: str | None = None  # prepared: the folder
    # the record keys; a kind that has no such setting reads its documents as these defaults say
    text_field: str = "text"  # the record field holding a document's text
    encoding: str = "utf-8"
    val_permille: int = 5
    piece_chars: int = 0  # text files longer than this are cut into pieces (train/data/pieces.py); 0: never
    # validation is the source's text from this place on, (file, record in the file, token offset), and nothing
    # is held out by hash: the probe cuts it where the held-out documents cannot hold what evaluation asks
    # (train/data/probe.py); None: the split by hash (and a cut file's last pieces)
    val_tail: tuple[int, int, int] | None = None

    def summary(self) -> str:
        """This source in a few words: its label and how many files, its Hub dataset, or its prepared folder."""
        if self.kind == "hub":
            return f"{self.label} {self.name}" + (f" ({self.config_name})" if self.config_name else "")
        if self.kind == "prepared":
            return f"{self.label} {self.path}"
        return f"{self.label} ({len(self.files):,} file{'s' if len(self.files) != 1 else ''})"

    def fingerprint(self) -> dict:
        """What fixes this source's documents; a resume state must come from a source with the same one."""
        names = "\n".join(os.path.basename(f) for f in self.files)
        hub = {"hub_streams": "by file when files >= streams"} if self.kind == "hub" else {}  # earlier: by record
        pieces = {"piece_chars": self.piece_chars} if self.piece_chars and self.reader == "text" else {}
        tail = {"val_tail": list(self.val_tail)} if self.val_tail is not None else {}
        return {
            **hub,
            **pieces,
            **tail,
            "kind": self.kind,
            "reader": self.reader,
            "name": os.path.basename(self.name) if self.name and os.path.isabs(self.name) else self.name,
            "config_name": self.config_name,
            "split": self.split,
            "path": os.path.basename(self.path) if self.path else None,
            "files": len(self.files),
            "files_crc32": zlib.crc32(names.encode()),
            "text_field": self.text_field,
            "encoding": codecs.lookup(self.encoding).name,
            "val_permille": self.val_permille,
        }


@dataclass(frozen=True)
class DataSpec:
    """A checked `data` config: its sources (one, or a weighted mixture) and the pipeline's shape."""

    sources: tuple[SourceSpec, ...]
    weights: tuple[float, ...]  # normalised to sum 1
    streams: int  # the pipeline, as the data section says (train/config/sections/data.py)
    shuffle_buffer: int
    workers: int
    prefetch: int
    on_bad_record: str
    read_retries: int  # a file that cannot be read is tried again this many times (train/data/reading.py)
    read_retry_s: float  # the wait before the first retry, doubling after each
    read_timeout_s: float  # data=hub: how long a request may wait for its next byte (train/data/hub_client.py)
    val_batches: int = 0  # global batches of validation windows the splits hold, as the probe found (train/data/probe.py)

    @property
    def mixture(self) -> bool:
        return len(self.sources) > 1

    @property
    def chunk_windows(self) -> int:
        """Windows each stream shuffles together (its share of the shuffle buffer)."""
        return self.shuffle_buffer // self.streams

    def val_shares(self, windows: int) -> list[int]:
        """Each source's whole share of `windows` validation windows, by the weights (largest remainders)."""
        exact = [w * windows for w in self.weights]
        counts = [int(x) for x in exact]
        for k in sorted(range(len(exact)), key=lambda k: counts[k] - exact[k])[: windows - sum(counts)]:
            counts[k] += 1
        return counts

    def summary(self) -> str:
        """The data in a few words, for a run's first line: each source and its size (files, a dataset's name, a
        prepared folder), a mixture's weights."""
        if not self.mixture:
            return self.sources[0].summary()
        return "mixture of " + ", ".join(f"{s.summary()} {w:.0%}" for s, w in zip(self.sources, self.weights))

    def fingerprint(self) -> dict:
        """What fixes the global order of windows (not dp, workers, prefetch, retries, timeouts or the bad-record
        policy)."""
        return {
            "sources": [s.fingerprint() for s in self.sources],
            "weights": list(self.weights),
            "streams": self.streams,
            "shuffle_buffer": self.shuffle_buffer,
        }


def check_data_config(data_cfg: DataConfig | Mapping) -> DataSpec:
    """Raise DataError if `data_cfg` cannot work: unknown source or key, missing file, empty glob,
    unsupported or mixed extensions, missing text field, unknown encoding, an unreachable Hub (for a Hub
    name that needs the network), a folder that is not a prepared dataset. Cheap: reads no documents."""
    return resolve(data_cfg)


def resolve(data_cfg: DataConfig | Mapping | DataSpec) -> DataSpec:
    """The data section (train/config/sections/data.py; a plain mapping of its keys is built into one) checked
    and its sources resolved; a DataSpec (the probe's, with its validation split cut) is already both."""
    if isinstance(data_cfg, DataSpec):
        return data_cfg
    try:
        section = data_cfg if isinstance(data_cfg, tuple(SCHEMAS.values())) else data_section(_plain(data_cfg))
    except ConfigError as err:
        raise DataError(str(err)) from None
    pipeline = dict(streams=section.streams, shuffle_buffer=section.shuffle_buffer, workers=section.workers,
                    prefetch=section.prefetch, on_bad_record=getattr(section, "on_bad_record", NO_BAD_RECORDS),
                    read_retries=section.read_retries, read_retry_s=float(section.read_retry_s),
                    read_timeout_s=float(section.read_timeout_s))
    record = {key: getattr(section, key) for key in RECORD_KEYS if hasattr(section, key)}
    if section.source != "mixture":
        return DataSpec((_source(_values(section), section.source, section.source, "data", record),), (1.0,), **pipeline)
    sources, weights = [], []
    for i, entry in enumerate(section.sources):
        where = f"data.sources[{i}]"
        entry = {k: v for k, v in entry.items() if v != NOT_SET}
        _refuse_unknown(entry, ENTRY_KEYS, where)
        kind = entry.get("source")
        if kind not in KINDS:
            raise DataError(f"{where}.source={kind!r} is not one of {list(KINDS)} (mixtures do not nest)")
        weight = entry.get("weight")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not weight > 0:
            raise DataError(f"{where}.weight={weight!r} must be a number > 0 (weights are relative; they are normalised)")
        _refuse_misplaced(entry, kind, where)
        label = str(entry.get("label") or f"{kind}{i}")
        sources.append(_source(entry, kind, label, where, _entry_record(entry, where, record)))
        weights.append(float(weight))
    labels = [s.label for s in sources]
    if len(set(labels)) < len(labels):
        raise DataError(f"data.sources: labels must differ; got {labels}")
    total = sum(weights)
    return DataSpec(tuple(sources), tuple(w / total for w in weights), **pipeline)


def _source(keys: dict, kind: str, label: str, where: str, record: dict) -> SourceSpec:
    """One source's spec from its kind's keys (`where` names it in messages) and its record keys."""
    if kind == "stdlib":
        return SourceSpec("stdlib", label, "text", files=_stdlib_files(), **record)
    if kind == "docstrings":
        return SourceSpec("docstrings", label, "docstrings", files=_stdlib_files(tests=False), **record)
    if kind == "files":
        files = _expand(None if keys.get("paths") == NOT_SET else keys.get("paths"), where)
        reader = _reader_of(files, where)
        _check_text_field(files[0], reader, record["text_field"], where)
        return SourceSpec("files", label, reader, files=files, **record)
    if kind == "hub":
        name = keys.get("name")
        if not name or name == NOT_SET:
            raise DataError(f"{where}.source=hub needs {where}.name, a Hugging Face Hub dataset (e.g. "
                            "HuggingFaceFW/fineweb) or a local dataset folder")
        name = str(name)
        _check_hub_reachable(name)
        if hub_location(name) == "local":  # the same folder whatever directory a rank starts in
            name = os.path.abspath(os.path.expanduser(name))
        split = keys.get("split") or HubData.split  # a mixture entry's left-out keys: the hub section's defaults
        config_name = keys.get("config_name", HubData.config_name)
        return SourceSpec("hub", label, "hub", name=name, config_name=config_name, split=split, **record)
    path = keys.get("path")
    if not path or path == NOT_SET:
        raise DataError(f"{where}.source=prepared needs {where}.path, a folder written by python -m train.prepare_data")
    meta = prepared_info(path, f"{where}.path")
    return SourceSpec("prepared", label, "prepared", path=os.path.abspath(os.path.expanduser(path)),
                      **{**record, "val_permille": meta["val_permille"], "encoding": meta["encoding"]})


def _plain(data_cfg: DataConfig | Mapping) -> dict:
    """A mapping of data keys (a dict, an omegaconf DictConfig, or a section of another schema) as a dict."""
    if dataclasses.is_dataclass(data_cfg):
        return dataclasses.asdict(data_cfg)
    if isinstance(data_cfg, dict):
        return data_cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_container(data_cfg, resolve=True)


def _values(section: DataConfig) -> dict:
    """The section's kind keys (paths, name, config_name, split, path) as a dict."""
    return {key: getattr(section, key) for key in KIND_KEYS[section.source]}


def _refuse_unknown(cfg: dict, valid: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(cfg) - set(valid))
    if unknown:
        raise DataError(f"{where}: unknown key(s) {unknown}; valid keys: {list(valid)}")


def _refuse_misplaced(cfg: dict, kind: str, where: str) -> None:
    """A key of another kind of source set to a value (e.g. paths with source=hub) is a mistake."""
    own = set(KIND_KEYS[kind])
    for other in KINDS:
        for key in set(KIND_KEYS[other]) - own:
            if cfg.get(key) not in (None, [], ""):
                raise DataError(f"{where}.{key} is for source={other}, not source={kind}; remove it")


def _entry_record(entry: dict, where: str, inherited: dict) -> dict:
    """A mixture entry's record keys: its own, checked as the section's are, else its mixture's."""
    record = dict(inherited)
    for key, check in ENTRY_CHECKS.items():
        value = entry.get(key)
        if value is None or value == "":
            continue
        if not check(value):
            raise DataError(check.refusal(f"{where}.{key}", value))
        record[key] = value
    return record


def _stdlib_files(tests: bool = True) -> tuple[str, ...]:
    """Every .py file of the running Python's standard library (installed packages excluded; tests=False:
    its test packages and test_*.py files too), in a fixed scrambled order (by crc32 of the path), so that
    one package's or test folder's files don't arrive as one long run, which a shuffle buffer of a few
    hundred windows cannot break up."""
    root = sysconfig.get_paths()["stdlib"]
    skipped = ("site-packages", "dist-packages") + (() if tests else TEST_FOLDERS)
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skipped]
        files += [os.path.join(folder, n) for n in names
                  if n.endswith(".py") and (tests or not n.startswith("test_"))]
    files.sort(key=lambda path: (zlib.crc32(os.path.relpath(path, root).encode()), path))
    if not files:
        raise DataError(f"the standard library has no .py files under {root}; use data=files")
    return tuple(files)


def _expand(paths, where: str) -> tuple[str, ...]:
    """Resolve a paths value (a path, glob or list of them) to the sorted files they name."""
    if not paths:
        raise DataError(f"{where}.source=files needs {where}.paths, e.g. {where}.paths=[/data/corpus/*.jsonl]")
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
        raise DataError(f"{where}.paths: " + "; ".join(missing))
    return tuple(sorted(files))


def _reader_of(files: tuple[str, ...], where: str) -> str:
    """The one reader for every file, from their extensions."""
    valid = ", ".join(READERS)
    unknown = sorted({os.path.splitext(f)[1] or "(none)" for f in files} - set(READERS))
    if unknown:
        raise DataError(f"{where}.paths: unsupported extension(s) {unknown}; valid: {valid}")
    readers = {READERS[os.path.splitext(f)[1]] for f in files}
    if len(readers) > 1:
        kinds = sorted({os.path.splitext(f)[1] for f in files})
        raise DataError(f"{where}.paths mixes file kinds {kinds}; use one kind per source ({valid}; .json and .jsonl mix)")
    return readers.pop()


def _check_text_field(first_file: str, reader: str, text_field: str, where: str) -> None:
    """For record files, check that the first file's first record carries `text_field` (a wrong field name
    is a config error, not a bad record). Reads the schema or the first line only."""
    if reader == "parquet":
        import pyarrow.parquet as pq

        try:
            fields = pq.read_schema(first_file).names
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for a file that is not parquet
            raise DataError(f"{where}.paths: {first_file} is not a parquet file ({e})") from None
    elif first_file.endswith(".jsonl"):
        with open(first_file, "rb") as f:
            line = f.readline()
        try:
            fields = list(json.loads(line)) if line.strip() else [text_field]
        except (ValueError, TypeError) as e:
            raise DataError(f"{where}.paths: {first_file} does not start with a JSON object per line ({e})") from None
    else:
        return
    if text_field not in fields:
        raise DataError(f"{where}.text_field={text_field!r} is not a field of {first_file}; its fields: {fields}")


def prepared_info(path: str, key: str = "data.path") -> dict:
    """What `train.prepare_data` recorded in a prepared folder (read from its metadata, not its data)."""
    folder = os.path.expanduser(str(path))
    info_file = os.path.join(folder, "train", "dataset_info.json")
    if not os.path.isfile(os.path.join(folder, "dataset_dict.json")) or not os.path.isfile(info_file):
        raise DataError(
            f"{key}={path!r} is not a prepared dataset (no dataset_dict.json with a train split); "
            "write one with python -m train.prepare_data <data overrides> out=FOLDER"
        )
    with open(info_file, encoding="utf-8") as f:
        description = json.load(f).get("description") or ""
    try:
        meta = json.loads(description)
    except ValueError:
        meta = {}
    if not isinstance(meta, dict) or meta.get("format") != PREPARED_MARK:
        raise DataError(f"{key}={path!r} holds a datasets folder that train.prepare_data did not write")
    return meta


def hub_offline() -> bool:
    """Whether Hugging Face offline mode is switched on, read from the environment now."""
    flag = os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE")
    if flag is not None:
        return flag.strip().upper() in {"1", "ON", "YES", "TRUE"}
    import datasets

    return bool(datasets.config.HF_HUB_OFFLINE)


def hub_location(name: str) -> str:
    """Where `datasets.load_dataset` finds `name`: "local" (a folder or file on this machine), "cache" (offline
    mode is on, so only the local datasets cache is looked in) or "network" (the Hub)."""
    if os.path.exists(os.path.expanduser(name)):
        return "local"
    return "cache" if hub_offline() else "network"


def _check_hub_reachable(name: str) -> None:
    """For a name that needs the network (not a local folder, offline mode off), fail fast with advice when the
    Hub cannot be reached: one TCP connect. A name that is not in the cache in offline mode is reported when
    the dataset is opened (`data_probe.check_data`, before any model is built)."""
    if hub_location(name) != "network":
        return
    unreachable = hub_unreachable()
    if unreachable:
        raise DataError(
            f"data.source=hub needs the Hugging Face Hub to stream {name!r}, but this machine cannot reach it "
            f"({unreachable}). data.name also takes a local dataset folder, or a dataset already in the "
            "local datasets cache with HF_DATASETS_OFFLINE=1; or train on local files: data=files "
            "'data.paths=[/path/to/*.jsonl]' (or data=stdlib)."
        ) from None


def hub_unreachable() -> str | None:
    """Why this machine cannot reach the Hugging Face Hub (its endpoint, HF_ENDPOINT, refused one TCP connect
    within 5 s), or None when it can, or behind a proxy, where a direct connection proves nothing (loading then
    reports any failure)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=5).close()
    except OSError as e:
        return f"{url.hostname}:{port}: {e}"
    return None
