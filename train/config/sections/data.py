"""`data.*`: where the training text comes from and how it becomes batches (docs/data.md).

Each kind of source has its own section, with the keys it reads: the group files in configs/data/
(`data=docstrings`, `stdlib`, `files`, `hub`, `prepared`, `mixture`, `gpt3_mixture`) each start from their kind's
schema, so a key of another kind (`data.paths` with `data=stdlib`) is refused when the config is
composed. Every key has its type, its one default and its check here; the data component reads the
built section (train/data/sources.py: resolve). `data_section` builds the same section from a plain
mapping (a mixture entry's keys are checked by the same checks, in train/data/sources.py).
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, List, Optional

from train.config.settings import OPTIONAL_TEXT, Check, ConfigError, Section, is_number, setting

SOURCES = ("stdlib", "docstrings", "files", "hub", "prepared", "mixture")
BAD_RECORD_POLICIES = ("skip", "error")
NOT_SET = "???"  # a mandatory key not given yet (OmegaConf's placeholder)


def _whole(low: int, note: str = "") -> Check:
    return Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low, f"must be a whole number >= {low}",
                 lambda key, v: f"{key}={v!r} must be a whole number >= {low}{note}")


def _one_of(choices: tuple[str, ...]) -> Check:
    return Check(lambda v: v in choices, f"must be one of {list(choices)}", lambda key, v: f"{key}={v!r} is not one of "
                                                                               f"{list(choices)}")


def _is_encoding(value) -> bool:
    try:
        codecs.lookup(value)
    except (LookupError, TypeError):
        return False
    return True


def _paths(value) -> bool:
    return value == NOT_SET or isinstance(value, str) or (isinstance(value, list) and all(isinstance(p, str) for p in value))


def _entries(value) -> bool:
    return isinstance(value, list) and all(isinstance(entry, Mapping) for entry in value)


def _first_bad_entry(key: str, value) -> str:
    if not isinstance(value, list):
        return f"{key}={value!r} must be a list of sources, each a mapping with source, weight and the source's keys"
    i, entry = next((i, e) for i, e in enumerate(value) if not isinstance(e, Mapping))
    return f"{key}[{i}] must be a mapping with source, weight and the source's keys; got {entry!r}"


SOURCE = _one_of(SOURCES)
BAD_RECORD = _one_of(BAD_RECORD_POLICIES)
ENCODING = Check(_is_encoding, "must be an encoding Python knows (e.g. utf-8, latin-1, cp1252)",
                 lambda key, v: f"{key}={v!r} is not an encoding Python knows; e.g. utf-8, latin-1, cp1252")
VAL_PERMILLE = Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1000,
                     "must be a whole number in [0, 1000)", lambda key, v: f"{key}={v!r} must be a whole number in [0, 1000)")
PIECE_CHARS = _whole(0, " (0: never cut a document)")
TEXT_FIELD = Check(lambda v: isinstance(v, str) and v != "", "must be the name of a record field (text)")
SECONDS = Check(lambda v: is_number(v) and 0 <= v < float("inf"), "must be a number of seconds >= 0",
                lambda key, v: f"{key}={v!r} must be a number of seconds >= 0")
POSITIVE_SECONDS = Check(lambda v: is_number(v) and 0 < v < float("inf"), "must be a number of seconds > 0",
                         lambda key, v: f"{key}={v!r} must be a number of seconds > 0")
PATHS = Check(_paths, "must be a path, a glob or a list of them")
NAME = Check(lambda v: isinstance(v, str) and v != "", "must be a dataset name or folder (text)")
SOURCE_LIST = Check(_entries, "must be a list of sources, each a mapping with source, weight and the source's keys",
                    _first_bad_entry)


@dataclass
class DataConfig(Section):
    """The keys every kind of source has: which kind, and the pipeline from documents to batches."""

    PREFIX: ClassVar[str] = "data"
    source: str = setting("docstrings", "the kind of source: `docstrings` (the prose of Python's standard-library "
                                        "docstrings: the quickstart), `stdlib` (its source code), `files`, `hub`, "
                                        "`prepared` or `mixture`", SOURCE)
    streams: int = setting(4, "record i goes to stream i mod streams; use (a multiple of) the largest data-parallel "
                              "size you will run; changing it changes the order", _whole(1))
    shuffle_buffer: int = setting(1024, "windows shuffled together, over all streams (a multiple of streams)", _whole(1))
    workers: int = setting(0, "background processes per rank that tokenize and pack ahead (GPU runs: 1-4)", _whole(0))
    prefetch: int = setting(2, "chunks per stream that workers keep ready ahead of training", _whole(1))
    read_retries: int = setting(5, "a data file that cannot be read (gone, a network file system's hiccup), or a Hub "
                                   "request that fails (429, 5xx, a dropped connection, a stall), is tried again this "
                                   "many times, each retry a warning; then the run saves a checkpoint and stops "
                                   "(docs/faults.md)", _whole(0))
    read_retry_s: float = setting(1.0, "seconds before the first retry of a data file or Hub request, doubling after "
                                       "each (longer when the Hub asks for it with Retry-After)", SECONDS)
    read_timeout_s: float = setting(10.0, "data=hub: seconds a request to the Hub may wait for its next byte before it "
                                          "fails and is retried (a stall)", POSITIVE_SECONDS)

    def check(self) -> None:
        if self.shuffle_buffer % self.streams:
            fits = self.shuffle_buffer - self.shuffle_buffer % self.streams or self.streams
            raise ConfigError(
                f"data.shuffle_buffer={self.shuffle_buffer} is not a multiple of data.streams={self.streams} (each stream "
                f"shuffles an equal share); use e.g. {fits}"
            )


def _on_bad_record():
    return setting("skip", "`skip`: skip bad records (undecodable, binary, not JSON, not Python, no text), count "
                           "them per file and warn once per file; `error`: stop at the first one", BAD_RECORD)


def _val_permille(default: int):
    return setting(default, "documents (by a hash of their text) held out for validation, per thousand; a corpus "
                            "whose held-out documents cannot hold what evaluation asks (one file, a few records) "
                            "holds out the last windows of its text instead, at most 10% of it (docs/data.md)",
                   VAL_PERMILLE)


def _encoding():
    return setting("utf-8", "how files are decoded (strict); e.g. latin-1 or cp1252 for older corpora", ENCODING)


def _text_field():
    return setting("text", "the record field holding a document (.jsonl/.json/.parquet, the Hub)", TEXT_FIELD)


def _piece_chars(default: int):
    return setting(default, "a .txt file longer than this is cut into pieces at blank lines, else line ends "
                            "(0: never cut a document; docs/data.md)", PIECE_CHARS)


@dataclass
class StdlibData(DataConfig):
    """`data=stdlib`: the Python standard library's source files, one document each."""

    source: str = setting("stdlib", "the kind of source", SOURCE)
    shuffle_buffer: int = setting(256, "windows shuffled together, over all streams (a multiple of streams)", _whole(1))
    encoding: str = _encoding()
    on_bad_record: str = _on_bad_record()
    val_permille: int = _val_permille(10)


@dataclass
class DocstringsData(DataConfig):
    """`data=docstrings`: the English prose of the standard library's docstrings, one document per file
    (train/data/docstrings.py)."""

    encoding: str = _encoding()
    on_bad_record: str = _on_bad_record()
    val_permille: int = _val_permille(10)


@dataclass
class RecordFiles(DataConfig):
    """The record keys of sources that read files of records: local files, and a mixture's entries."""

    text_field: str = _text_field()
    encoding: str = _encoding()
    on_bad_record: str = _on_bad_record()


@dataclass
class FilesData(RecordFiles):
    """`data=files`: local files."""

    source: str = setting("files", "the kind of source", SOURCE)
    paths: Any = setting(NOT_SET, "files or globs (.txt: one document per file; .jsonl/.json/.parquet: one per record)",
                         PATHS, example="'data.paths=[input.txt]'")
    piece_chars: int = _piece_chars(16384)
    val_permille: int = _val_permille(5)


@dataclass
class HubData(DataConfig):
    """`data=hub`: a Hugging Face Hub dataset (or a local dataset folder), streamed with `datasets`."""

    source: str = setting("hub", "the kind of source", SOURCE)
    shuffle_buffer: int = setting(4096, "windows shuffled together, over all streams (a multiple of streams)", _whole(1))
    name: str = setting(NOT_SET, "the dataset: a Hub name (e.g. HuggingFaceFW/fineweb) or a local dataset folder", NAME,
                        example="data.name=HuggingFaceFW/fineweb data.config_name=sample-10BT")
    config_name: Optional[str] = setting(None, "the dataset's configuration", OPTIONAL_TEXT)
    split: str = setting("train", "the split to stream", NAME)
    text_field: str = _text_field()
    on_bad_record: str = _on_bad_record()
    val_permille: int = _val_permille(1)


@dataclass
class PreparedData(DataConfig):
    """`data=prepared`: a corpus tokenized once by python -m train.prepare_data."""

    source: str = setting("prepared", "the kind of source", SOURCE)
    path: str = setting(NOT_SET, "the folder python -m train.prepare_data wrote", NAME, example="data.path=data/owt-gpt2")


@dataclass
class MixtureData(RecordFiles):
    """`data=mixture`: several sources in fixed shares; each entry's record keys default to these."""

    source: str = setting("mixture", "the kind of source", SOURCE)
    sources: List[Dict[str, Any]] = setting(doc="a list of sources, each with a label, a weight and its own kind's "
                                                "keys", check=SOURCE_LIST, factory=list)
    piece_chars: int = _piece_chars(0)
    val_permille: int = _val_permille(5)

    def check(self) -> None:
        super().check()
        if not self.sources:
            raise ConfigError("data.source=mixture needs data.sources, a list of sources each with a weight, e.g. "
                              "[{label: web, weight: 0.8, source: files, paths: [...]}, {label: wiki, weight: 0.2, ...}]")


# The schema each group file in configs/data/ starts from (its defaults list names it).
KINDS = {"docstrings": DocstringsData, "stdlib": StdlibData, "files": FilesData, "hub": HubData,
         "prepared": PreparedData, "mixture": MixtureData}
# A source's record keys: how its documents are read (a mixture entry's default to its mixture's)
RECORD_KEYS = ("text_field", "encoding", "val_permille", "piece_chars")
# The keys of one kind of source alone (a mixture entry may set its kind's)
KIND_KEYS = {kind: tuple(f.name for f in fields(schema) if f.name not in {g.name for g in fields(DataConfig)}
                         and f.name not in RECORD_KEYS and f.name != "on_bad_record")
             for kind, schema in KINDS.items()}


def data_section(values: Mapping) -> DataConfig:
    """The section of `values` (a plain mapping of data keys, or an omegaconf DictConfig) on its kind's schema:
    keys left out, null or '???' take the schema's defaults. ConfigError names the first bad key or value."""
    if not isinstance(values, dict):
        from omegaconf import OmegaConf

        values = OmegaConf.to_container(values, resolve=True)
    given = {key: value for key, value in values.items() if value is not None and value != NOT_SET}
    source = given.get("source", DataConfig.source)
    if source not in KINDS:
        raise ConfigError(SOURCE.refusal("data.source", source))
    schema = KINDS[source]
    own = {f.name for f in fields(schema)}
    for key in given:
        if key in own:
            continue
        other = next((kind for kind, keys in KIND_KEYS.items() if key in keys), None)
        if other is not None and given[key] not in ([], ""):
            raise ConfigError(f"data.{key} is for source={other}, not source={source}; remove it")
        if other is None:
            raise ConfigError(f"data: unknown key(s) {sorted(set(given) - own)}; valid keys: {sorted(own)}")
    return schema(**{key: value for key, value in given.items() if key in own})
