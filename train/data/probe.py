"""Early data checks, before any model is built: the batch geometry and a cheap look at the corpus.

`check_data` resolves the config, checks that global batches split over streams and ranks, then reads
each source only until every stream has a training document (and, if validation is asked for, until one
validation document shows up). An empty corpus, one that is all bad records, one whose training split is
empty, or one with fewer training documents than streams is one clear error here, instead of a failure
mid-run. With ``on_bad_record=error`` a bad record among those read stops the run here too.

A `datasets` source (data.source=hub) is opened here, so a name that cannot be found (not on the Hub, not
a folder, not in the cache in offline mode) fails here. When it has at least data.streams data files its
streams are sets of files (`data_records`), and the probe reads no training record: every rank runs it,
and reading one record of every stream would make each rank open every stream's first file. With fewer
files than streams it says so in one line (every stream then reads the whole dataset) and probes as for
other record sources.
"""

from __future__ import annotations

import sys

import numpy as np

from train import report
from train.data.records import Bad, BadRecords, by_files, in_validation, open_hub, prepared_split, records
from train.data.sources import DataError, DataSpec, SourceSpec, plain_config, resolve


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

    def __init__(self, message: str, indices: list[int]):
        super().__init__(message)
        self.indices = indices


def check_data(data_cfg, dp_size: int = 1, global_batch: int | None = None, validation: bool = False,
               streams_set: bool = True) -> DataSpec:
    """Resolve `data_cfg`, check the batch geometry (when `global_batch` is given) and probe every source:
    it must hold a training document for every stream, and a validation document if `validation`.

    When some stream would get no training document and data.streams was not set by the user
    (`streams_set` False), the returned spec has the largest smaller data.streams that feeds every stream
    and still fits the geometry (divides the shuffle buffer and the global batch; divides dp or dp divides
    it), with one warning on rank 0; with `streams_set` it is an error."""
    spec = resolve(data_cfg)
    if global_batch is not None:
        check_layout(spec, 1, global_batch, 0, dp_size)
    for src in spec.sources:
        if src.reader == "prepared":
            _probe_prepared(src, spec.streams, validation)
        elif src.reader == "hub" and _hub_by_files(src, spec.streams):
            if validation:
                _probe_validation(src, spec)
        else:
            try:
                _probe_records(src, spec, validation)
            except TooFewDocuments as err:
                fewer = None if streams_set else _fewer_streams(spec, err.indices, dp_size, global_batch)
                if fewer is None:
                    raise DataError(str(err)) from None
                _warn_fewer(src, spec.streams, fewer, len(err.indices))
                return check_data({**plain_config(data_cfg), "streams": fewer}, dp_size, global_batch, validation, True)
    return spec


def _fewer_streams(spec: DataSpec, indices: list[int], dp_size: int, global_batch: int | None) -> int | None:
    """The largest data.streams below spec.streams that gives every stream a training document (record i goes
    to stream i mod streams) and fits the geometry; None if there is none."""
    for streams in range(spec.streams - 1, 0, -1):
        fits = (spec.shuffle_buffer % streams == 0 and (global_batch is None or global_batch % streams == 0)
                and (streams % dp_size == 0 or dp_size % streams == 0))
        if fits and len({i % streams for i in indices}) == streams:
            return streams
    return None


def _warn_fewer(src: SourceSpec, streams: int, fewer: int, n_train: int) -> None:
    from train.config.launch import is_rank_zero

    report.warn(f"data: {src.label} has {n_train} training document(s), too few for data.streams={streams}; "
                f"using data.streams={fewer} (set data.streams on the command line to make this an error)",
                speaks=is_rank_zero())


def _probe_records(src: SourceSpec, spec: DataSpec, validation: bool) -> None:
    """Read records in order until every stream has a training document and validation one (if asked)."""
    streams, bad = spec.streams, BadRecords(spec.on_bad_record, warn=False)
    missing, found_validation = set(range(streams)), not validation
    n_records = n_empty = n_val = 0
    train_indices = []
    for record in records(src, 0, 1):
        n_records += 1
        if isinstance(record.text, Bad):
            bad.skip(record)  # raises with on_bad_record=error
        elif not record.text:
            n_empty += 1
        elif in_validation(record, src.val_permille):
            n_val, found_validation = n_val + 1, True
        else:
            train_indices.append(record.index)
            missing.discard(record.index % streams)
        if not missing and found_validation:
            return
    n_train = len(train_indices)
    where = f"data: {src.label}"
    if n_train + n_val == 0:
        skipped = "; ".join(f"{f}: {', '.join(f'{r} ×{n}' for r, n in c.items())}" for f, c in bad.counts.items())
        raise DataError(
            f"{where}: the corpus holds no text to train on: {n_records} record(s) read, {n_empty} empty"
            + (f", {n_records - n_empty} skipped as bad ({skipped})" if skipped else "")
        )
    if n_train == 0:
        raise DataError(
            f"{where}: the training split is empty: all {n_val} document(s) are held out for validation by "
            f"val_permille={src.val_permille}; lower data.val_permille or add documents"
        )
    if missing:
        raise TooFewDocuments(
            f"{where}: with data.streams={streams}, stream(s) {sorted(missing)[:8]} get no training document (record i "
            f"goes to stream i mod data.streams; the corpus has {n_train} training documents in {n_records} records); "
            f"lower data.streams", train_indices
        )
    raise DataError(
        f"{where}: the validation split is empty (val_permille={src.val_permille}, {n_train} training documents) but "
        "validation is asked for; raise data.val_permille, or set train.eval_interval=0"
    )


def _hub_by_files(src: SourceSpec, streams: int) -> bool:
    """Open a `datasets` source (reading no record) and say whether its streams are sets of files; if not (and
    streams > 1), say once what that costs."""
    from train.config.launch import is_rank_zero

    files = open_hub(src).n_shards
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
    for record in records(src, 0, 1):
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
