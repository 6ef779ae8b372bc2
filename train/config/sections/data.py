"""`data.*`: where the training text comes from and how it becomes batches (docs/data.md).

Each kind of source has its own section, with the keys it reads: the group files in configs/data/
(`data=docstrings`, `stdlib`, `files`, `hub`, `prepared`, `mixture`, `gpt3_mixture`) each start from their kind's
schema, so a key of another kind (`data.paths` with `data=stdlib`) is refused when the config is
composed. The data component checks the values beside its own code, where each key is used
(train/data/sources.py: resolve; the probe of the corpus, train/data/probe.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from train.config.settings import Section, setting


@dataclass
class DataConfig(Section):
    """The keys every kind of source has: which kind, and the pipeline from documents to batches."""

    PREFIX: ClassVar[str] = "data"
    source: Any = setting("docstrings", "the kind of source: `docstrings` (the prose of Python's standard-library "
                                        "docstrings: the quickstart), `stdlib` (its source code), `files`, `hub`, "
                                        "`prepared` or `mixture`")
    streams: Any = setting(4, "record i goes to stream i mod streams; use (a multiple of) the largest data-parallel "
                              "size you will run; changing it changes the order")
    shuffle_buffer: Any = setting(1024, "windows shuffled together, over all streams (a multiple of streams)")
    workers: Any = setting(0, "background processes per rank that tokenize and pack ahead (GPU runs: 1-4)")
    prefetch: Any = setting(2, "chunks per stream that workers keep ready ahead of training")
    read_retries: Any = setting(5, "a data file that cannot be read (gone, a network file system's hiccup) is tried "
                                   "again this many times, each retry a warning; then the run saves a checkpoint "
                                   "and stops (docs/faults.md)")
    read_retry_s: Any = setting(1.0, "seconds before the first retry of a data file, doubling after each")


def _on_bad_record():
    return setting("skip", "`skip`: skip bad records (undecodable, binary, not JSON, not Python, no text), count "
                           "them per file and warn once per file; `error`: stop at the first one")


def _val_permille(default: int):
    return setting(default, "documents (by a hash of their text) held out for validation, per thousand; a corpus "
                            "whose held-out documents cannot hold what evaluation asks (one file, a few records) "
                            "holds out the last windows of its text instead, at most 10% of it (docs/data.md)")


def _encoding():
    return setting("utf-8", "how files are decoded (strict); e.g. latin-1 or cp1252 for older corpora")


def _text_field():
    return setting("text", "the record field holding a document (.jsonl/.json/.parquet, the Hub)")


@dataclass
class StdlibData(DataConfig):
    """`data=stdlib`: the Python standard library's source files, one document each."""

    encoding: Any = _encoding()
    on_bad_record: Any = _on_bad_record()
    val_permille: Any = _val_permille(10)


@dataclass
class DocstringsData(DataConfig):
    """`data=docstrings`: the English prose of the standard library's docstrings, one document per file
    (train/data/docstrings.py)."""

    encoding: Any = _encoding()
    on_bad_record: Any = _on_bad_record()
    val_permille: Any = _val_permille(10)


@dataclass
class FilesData(DataConfig):
    """`data=files`: local files."""

    source: Any = "files"
    paths: Any = setting("???", "files or globs (.txt: one document per file; .jsonl/.json/.parquet: one per record)")
    text_field: Any = _text_field()
    encoding: Any = _encoding()
    on_bad_record: Any = _on_bad_record()
    piece_chars: Any = setting(16384, "a .txt file longer than this is cut into pieces at blank lines, else line ends "
                                      "(0: never cut a document; docs/data.md)")
    val_permille: Any = _val_permille(5)


@dataclass
class HubData(DataConfig):
    """`data=hub`: a Hugging Face Hub dataset (or a local dataset folder), streamed with `datasets`."""

    source: Any = "hub"
    name: Any = setting("???", "the dataset: a Hub name (e.g. HuggingFaceFW/fineweb) or a local dataset folder")
    config_name: Any = setting(None, "the dataset's configuration")
    split: Any = setting("train", "the split to stream")
    text_field: Any = _text_field()
    on_bad_record: Any = _on_bad_record()
    val_permille: Any = _val_permille(1)


@dataclass
class PreparedData(DataConfig):
    """`data=prepared`: a corpus tokenized once by python -m train.prepare_data."""

    source: Any = "prepared"
    path: Any = setting("???", "the folder python -m train.prepare_data wrote")


@dataclass
class MixtureData(DataConfig):
    """`data=mixture`: several sources in fixed shares."""

    source: Any = "mixture"
    sources: Any = setting(doc="a list of sources, each with a label, a weight and its own kind's keys",
                           factory=list)
    text_field: Any = _text_field()
    encoding: Any = _encoding()
    on_bad_record: Any = _on_bad_record()
    val_permille: Any = _val_permille(5)


# The schema each group file in configs/data/ starts from (its defaults list names it).
KINDS = {"docstrings": DocstringsData, "stdlib": StdlibData, "files": FilesData, "hub": HubData,
         "prepared": PreparedData, "mixture": MixtureData}
