"""Early data checks, before any model is built: the batch geometry and a cheap look at the corpus.

`check_data` resolves the config, checks that global batches split over streams and ranks, then reads
each source only until every stream has a training document and, when validation is on, until the
documents held out for it hold the windows evaluation asks for (`Evaluation`: train.eval_batches global
batches of model.seq_len + 1 tokens; a mixture's sources each their share). An empty corpus, one that is
all bad records, or one with fewer training documents than streams is one clear error here, instead of a
failure mid-run. With ``on_bad_record=error`` a bad record among those read stops the run here too.

**A validation split sized to what evaluation asks.** A local source (stdlib, files) whose held-out
documents cannot hold its share (few documents: one text file, a short .jsonl) holds out its tail
instead: the last windows of its text in reading order, cut by tokens (`Tail`), and nothing by hash;
the probe reads and tokenizes such a source once more to find the cut. A tail holds at most
MAX_HELD_OUT (10%) of the source's tokens; when that is fewer windows than asked, evaluation uses the
whole batches that fit (the returned spec's `val_batches`, with one note), and when not even one batch
fits the run is refused, naming the settings that would fix it.

A `datasets` source (data.source=hub) is opened here, so a name that cannot be found (not on the Hub, not
a folder, not in the cache in offline mode) fails here. When it has at least data.streams data files its
streams are sets of files (`data_records`), and the probe reads no training record: every rank runs it,
and reading one record of every stream would make each rank open every stream's first file. With fewer
files than streams it says so in one line (every stream then reads the whole dataset) and probes as for
other record sources, without a tail.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from train.config.sections import DataConfig
from train.data.records import (
    ENCODING_HINT,
    Bad,
    BadRecords,
    by_files,
    in_validation,
    open_hub,
    place,
    prepared_split,
    records,
    tokens_of,
)
from train.data.reading import Reader
from train.data.sources import DataError, DataSpec, SourceSpec, resolve
from train.monitor import report

MAX_HELD_OUT = 0.1  # the largest share of a source's tokens its validation tail may take
TAIL_READERS = ("text", "json", "parquet")  # local records, whose places (records.place) a tail can name


@dataclass(frozen=True)
class Evaluation:
    """What evaluation asks of the validation split: `batches` global batches of `batch` windows of `window`
    (model.seq_len + 1) tokens."""

    window: int
    batch: int
    batches: int


def check_layout(spec: DataSpec, seq_len: int, batch: int, dp_rank: int, dp_size: int) -> None:
    """Reject window and batch shapes that cannot be served evenly to every stream and data-parallel rank."""
    streams = spec.streams
    if seq_len < 1 or batch < 1:
        raise DataError(f"data: seq_len={seq_len} and batch={batch} must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"data: dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
    if streams % dp_size and dp_size % streams:
        fits = [d for d in range(dp_size, 8 * dp_size + 1, dp_size) if batch % d == 0][:3] or [dp_size]
        raise DataError(
            f"data.streams={streams} and data-parallel size {dp_size}: one must divide the other (a rank reads "
            f"whole streams); use data.streams in {fits} (changing data.streams changes the data order)"
        )
    if batch % dp_size:
        raise DataError(f"data: a global batch of {batch} windows does not split evenly over {dp_size} data-parallel ranks")
    if batch % streams:
        raise DataError(
            f"data: a global batch of {batch} windows is not a multiple of data.streams={streams} (every global batch "
            f"takes the same number of windows from each stream); use a multiple of {streams} or fewer streams"
        )


class TooFewDocuments(DataError):
    """Some stream gets no training document; `indices` are the source's training record indices."""

    def __init__(self, message: str, label: str, indices: list[int]):
        super().__init__(message)
        self.label, self.indices = label, indices


def check_data(data_cfg: DataConfig | Mapping | DataSpec, dp_size: int = 1, global_batch: int | None = None, evaluation: Evaluation | None = None,
               streams_set: bool = True) -> DataSpec:
    """Resolve `data_cfg`, check the batch geometry (when `global_batch` is given) and probe every source:
    it must hold a training document for every stream and, with `evaluation`, a validation split holding
    what it asks (see the module docstring). The spec returned has the tails cut and `val_batches` set.

    When some stream would get no training document and data.streams was not set by the user
    (`streams_set` False), the returned spec has the largest smaller data.streams that feeds every stream
    and still fits the geometry (divides the shuffle buffer and the global batch; divides dp or dp divides
    it), with one warning on rank 0; with `streams_set` it is an error."""
    spec = resolve(data_cfg)
    if global_batch is not None:
        check_layout(spec, 1, global_batch, 0, dp_size)
    try:
        return _probe(spec, evaluation)
    except TooFewDocuments as err:
        fewer = None if streams_set else _fewer_streams(spec, err.indices, dp_size, global_batch)
        if fewer is None:
            raise DataError(str(err)) from None
        _warn_fewer(err.label, spec.streams, fewer, len(err.indices))
        return check_data(dataclasses.replace(spec, streams=fewer), dp_size, global_batch, evaluation, True)


def _probe(spec: DataSpec, evaluation: Evaluation | None) -> DataSpec:
    """Every source probed; the spec with its tails cut and the validation batches they hold."""
    window = evaluation.window if evaluation else 0
    asked = spec.val_shares(evaluation.batch * evaluation.batches) if evaluation else [0] * len(spec.sources)
    tails: dict[int, Tail] = {}
    for j, (src, need) in enumerate(zip(spec.sources, asked)):
        if src.reader == "prepared":
            _probe_prepared(src, spec.streams, need > 0)
        elif src.reader == "hub" and _hub_by_files(src, spec):
            if need:
                _probe_validation(src, spec)
        else:
            tail = _probe_records(src, spec, need, window)
            if tail is not None:
                tails[j] = tail
    if not tails:
        return dataclasses.replace(spec, val_batches=evaluation.batches if evaluation else 0)
    for tail in tails.values():  # a corpus too small for its streams says so before anything about validation
        tail.feeds(spec.streams)
    batches = _batches_held(spec, tails, evaluation)
    shares = spec.val_shares(batches * evaluation.batch)
    sources = [tails[j].cut(shares[j], spec.streams) if j in tails and shares[j] else src
               for j, src in enumerate(spec.sources)]
    return dataclasses.replace(spec, sources=tuple(sources), val_batches=batches)


def _fewer_streams(spec: DataSpec, indices: list[int], dp_size: int, global_batch: int | None) -> int | None:
    """The largest data.streams below spec.streams that gives every stream a training document (record i goes
    to stream i mod streams) and fits the geometry; None if there is none."""
    for streams in range(spec.streams - 1, 0, -1):
        fits = (spec.shuffle_buffer % streams == 0 and (global_batch is None or global_batch % streams == 0)
                and (streams % dp_size == 0 or dp_size % streams == 0))
        if fits and len({i % streams for i in indices}) == streams:
            return streams
    return None


def _warn_fewer(label: str, streams: int, fewer: int, n_train: int) -> None:
    from train.config.launch import is_rank_zero

    report.warn(f"data: {label} has {n_train} training document(s), too few for data.streams={streams}; "
                f"using data.streams={fewer} (set data.streams on the command line to make this an error)",
                speaks=is_rank_zero())


def _probe_records(src: SourceSpec, spec: DataSpec, need: int, window: int) -> "Tail | None":
    """Read records in order until every stream has a training document and the held-out documents hold
    `need` windows of `window` tokens. None when they do; a source that ends first holds out its `Tail`
    instead (a local source), or, from the Hub, is refused only when it holds out no document at all."""
    streams, bad = spec.streams, BadRecords(spec.on_bad_record, warn=False)
    missing, wanted = set(range(streams)), need * window
    n_records = n_empty = n_val = held = 0
    train_indices = []
    # the Hub's requests are retried as training retries them; a local file is read once (no retry) here
    for record in records(src, 0, 1, reader=Reader.of(spec) if src.reader == "hub" else None):
        n_records += 1
        if isinstance(record.text, Bad):
            bad.skip(record)  # raises with on_bad_record=error
        elif not record.text:
            n_empty += 1
        elif in_validation(record, src.val_permille):
            n_val += 1
            held += len(tokens_of(record.text)) if held < wanted else 0
        else:
            train_indices.append(record.index)
            missing.discard(record.index % streams)
        if not missing and held >= wanted:
            return None
    n_train = len(train_indices)
    where = f"data: {src.label}"
    if n_train + n_val == 0:
        skipped = "; ".join(f"{f}: {', '.join(f'{r} ×{n}' for r, n in c.items())}" for f, c in bad.counts.items())
        undecodable = any("undecodable" in reasons for reasons in bad.counts.values())
        raise DataError(
            f"{where}: the corpus holds no text to train on: {n_records} record(s) read, {n_empty} empty"
            + (f", {n_records - n_empty} skipped as bad ({skipped})" if skipped else "")
            + (ENCODING_HINT if undecodable else "")
        )
    if held < wanted and src.reader in TAIL_READERS:
        return Tail.read(src, window)
    if n_train == 0:
        raise DataError(
            f"{where}: the training split is empty: all {n_val} document(s) are held out for validation by "
            f"val_permille={src.val_permille}; lower data.val_permille or add documents"
        )
    if missing:
        raise TooFewDocuments(
            f"{where}: with data.streams={streams}, stream(s) {sorted(missing)[:8]} get no training document (record i "
            f"goes to stream i mod data.streams; the corpus has {n_train} training documents in {n_records} records); "
            f"lower data.streams", src.label, train_indices
        )
    if n_val == 0:
        raise DataError(
            f"{where}: the validation split is empty (val_permille={src.val_permille}, {n_train} training documents) "
            "but validation is asked for; raise data.val_permille, or set train.eval_interval=0"
        )
    return None


@dataclass(frozen=True)
class Tail:
    """A local source whose validation is the tail of its text: every document's place (records.place),
    record index and token count (its GPT-2 tokens and <|endoftext|>), in reading order."""

    src: SourceSpec
    window: int
    places: list[tuple[int, int]]
    indices: list[int]
    tokens: list[int]

    @classmethod
    def read(cls, src: SourceSpec, window: int) -> "Tail":
        """Every document of `src` tokenized (bad records were counted by the probe's first reading)."""
        places, indices, tokens = [], [], []
        for record in records(src, 0, 1):
            if not isinstance(record.text, Bad) and record.text:
                places.append(place(record))
                indices.append(record.index)
                tokens.append(len(tokens_of(record.text)))
        return cls(src, window, places, indices, tokens)

    @property
    def total(self) -> int:
        """The source's tokens."""
        return sum(self.tokens)

    @property
    def room(self) -> int:
        """The most validation windows the tail may hold: MAX_HELD_OUT of the source's tokens."""
        return int(self.total * MAX_HELD_OUT) // self.window

    def cut(self, windows: int, streams: int) -> SourceSpec:
        """The source with its last `windows` (≥ 1) windows held out (SourceSpec.val_tail); TooFewDocuments
        when a stream is left without a training document."""
        left, k = windows * self.window, len(self.tokens)
        while left > 0:
            k -= 1
            left -= self.tokens[k]
        offset = -left  # the tail starts this many tokens into document k
        self.feeds(streams, self.indices[:k] + (self.indices[k : k + 1] if offset else []),
                   f" once the last {windows} windows are held out for validation")
        return dataclasses.replace(self.src, val_tail=(*self.places[k], offset))

    def feeds(self, streams: int, training: list[int] | None = None, when: str = "") -> None:
        """TooFewDocuments unless the `training` documents (by record index; None: all) feed every stream."""
        training = self.indices if training is None else training
        missing = sorted(set(range(streams)) - {i % streams for i in training})
        if missing:
            raise TooFewDocuments(
                f"data: {self.src.label}: with data.streams={streams}, stream(s) {missing[:8]} get no training document"
                f"{when} (record i goes to stream i mod data.streams; the corpus has {len(training)} training "
                "documents); lower data.streams", self.src.label, training
            )


def _batches_held(spec: DataSpec, tails: dict[int, Tail], evaluation: Evaluation) -> int:
    """The most global batches of validation windows, up to those asked, whose shares fit every tail; one note
    when that is fewer than asked; DataError when not even one batch fits."""
    from train.config.launch import is_rank_zero

    def fits(batches: int) -> bool:
        shares = spec.val_shares(batches * evaluation.batch)
        return all(shares[j] <= tail.room for j, tail in tails.items())

    batches = next((b for b in range(evaluation.batches, 0, -1) if fits(b)), 0)
    tight = min(tails.values(), key=lambda tail: tail.room)
    corpus = f"source {tight.src.label}" if spec.mixture else "the corpus"
    limit = f"validation may take at most {MAX_HELD_OUT:.0%} of {corpus}'s {tight.total:,} tokens"
    if batches == 0:
        raise DataError(
            f"data: {tight.src.label}: {limit}, too few for one validation batch of {evaluation.batch} windows of "
            f"{evaluation.window} tokens; set train.eval_interval=0 (no validation), or lower train.global_batch_size "
            "or model.seq_len, or add text"
        )
    if batches < evaluation.batches:
        report.say(f"gpt3d: note: data: {limit}: {batches} of the {evaluation.batches} validation batches "
                   f"train.eval_batches asks for ({evaluation.batch} windows of {evaluation.window} tokens each); each "
                   f"validation pass uses {batches}", speaks=is_rank_zero())
    return batches


def _hub_by_files(src: SourceSpec, spec: DataSpec) -> bool:
    """Open a `datasets` source (reading no record) and say whether its streams are sets of files; if not (and
    streams > 1), say once what that costs."""
    from train.config.launch import is_rank_zero

    streams = spec.streams
    files = open_hub(src, Reader.of(spec)).n_shards
    if by_files(files, streams):
        return True
    if is_rank_zero():
        print(
            f"gpt3d: note: data: {src.label}: {src.name!r} has {files} data file(s), fewer than data.streams={streams}, so "
            f"its records are dealt to streams: every stream reads the whole dataset and keeps every {streams}th record "
            f"(each rank downloads and parses all of it); data.streams <= {files} would split it by file",
            file=sys.stderr, flush=True,
        )
    return False


def _probe_validation(src: SourceSpec, spec: DataSpec) -> None:
    """Read records in order (as validation does) until a validation document shows up."""
    bad, n_train = BadRecords(spec.on_bad_record, warn=False), 0
    for record in records(src, 0, 1, reader=Reader.of(spec)):
        if isinstance(record.text, Bad):
            bad.skip(record)
        elif record.text and in_validation(record, src.val_permille):
            return
        elif record.text:
            n_train += 1
    raise DataError(
        f"data: {src.label}: the validation split is empty (val_permille={src.val_permille}, {n_train} training documents) "
        "but validation is asked for; raise data.val_permille, or set train.eval_interval=0"
    )


def _probe_prepared(src: SourceSpec, streams: int, validation: bool) -> None:
    train = prepared_split(src.path, "train")
    if len(train.docs) == 0:
        raise DataError(f"data: {src.label}: the prepared training split at {src.path} is empty")
    fed = np.bincount(train.docs % streams, minlength=streams) > 0  # (streams,) bool
    if not fed.all():
        missing = np.flatnonzero(~fed)[:8].tolist()
        raise DataError(f"data: {src.label}: with data.streams={streams}, stream(s) {missing} get no training document "
                        f"({len(train.docs)} documents in {src.path}); lower data.streams")
    if validation and len(prepared_split(src.path, "validation").docs) == 0:
        raise DataError(f"data: {src.label}: the prepared validation split at {src.path} is empty but validation is "
                        "asked for; set train.eval_interval=0, or prepare with a larger data.val_permille")
