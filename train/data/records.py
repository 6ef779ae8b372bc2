"""Reading a source's records, one stream's share of them, and turning them into documents.

Records are numbered in the source's fixed reading order (files in order, records in each file; the
Hub's or a prepared dataset's own order): record i belongs to stream ``i % streams``. A stream reads
only its own records' text: for a one-document-per-file source it opens only its own files; for
``.jsonl`` it splits every line but decodes and parses only its own; for parquet it converts only its
own rows.

A `datasets` source (``data.source=hub``) is split by file instead when it has at least as many data files
as streams (datasets' ``n_shards``): stream j is datasets' own shard j (``IterableDataset.shard(S, j,
contiguous=False)``: files j, j+S, j+2S, …), so a stream opens, downloads and parses only its files and
its records are numbered within it. With fewer files than streams every stream reads the whole dataset
and keeps its records by index, as above.

Decoding is explicit: bytes are decoded with the source's ``encoding`` (strict). A record that cannot
be decoded, holds NUL characters (binary data), is not a JSON object, or has no text in the text field
is a *bad record*: `BadRecords` counts it per file and reason and warns once per file, or, with
``on_bad_record=error``, stops with the file and the record's number. Empty documents are skipped
silently (they would only add an ``<|endoftext|>``).

Files are opened through a `Reader` (train/data/reading.py), which tries a read that fails again for a
while and then names the file (DataUnavailable); so are the HTTP requests of a dataset streamed from the Hub
(train/data/hub_client.py), which then name the URL.

Every position is a plain dict (ints, strings; for the Hub, datasets' own state), fit for a checkpoint:
reading resumes at a record without re-reading what came before it (a ``.jsonl`` file is entered by
its byte offset, parquet by row group).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from train.data import docstrings, pieces
from train.data.reading import Reader
from train.data.sources import DataError, SourceSpec, hub_location, hub_offline
from train.data.tokenizer import EOT, gpt2
from train.monitor import report

TOKEN_BLOCK = 256  # prepared rows fetched from Arrow at a time
ENCODING_HINT = "; if the corpus uses another encoding, set data.encoding (e.g. latin-1, cp1252)"


@dataclass(frozen=True)
class Bad:
    """Why a record was skipped: reason is a short key for the counts, detail a sentence for people."""

    reason: str  # undecodable | binary | not_json | not_python | no_text
    detail: str


@dataclass(frozen=True)
class Record:
    """One record of a stream: where to resume reading at it, its number, its file, and its text (or why not)."""

    pos: dict
    index: int  # in the source's reading order (all records, bad ones included)
    file: str
    where: str  # "line 12", "row 7", ... for messages
    text: str | Bad
    held_out: bool | None = None  # a piece of a cut document (train/data/pieces.py): its split; None: by hash


class BadRecords:
    """Skipped records per file and reason; warns once per (file, reason), or stops in error mode.

    counts: {file: {reason: n}}, plain and JSON-able, so it travels in a resume state.
    warned: the (file, reason) pairs already shown; the lanes one process reads share one set.
    """

    def __init__(self, policy: str = "skip", warn: bool = True, counts: dict | None = None, warned: set | None = None):
        self.policy, self.warn = policy, warn
        self.counts: dict[str, dict[str, int]] = copy.deepcopy(counts or {})
        self._warned: set[tuple[str, str]] = set() if warned is None else warned  # may be shared by a process's lanes

    def skip(self, record: Record) -> None:
        bad = record.text
        if self.policy == "error":
            raise DataError(
                f"data: {record.file}: {record.where}: {bad.detail}; stopped here because data.on_bad_record=error "
                "(data.on_bad_record=skip skips such records and counts them)"
            )
        per_file = self.counts.setdefault(record.file, {})
        per_file[bad.reason] = per_file.get(bad.reason, 0) + 1
        if self.warn and (record.file, bad.reason) not in self._warned:
            self._warned.add((record.file, bad.reason))
            report.warn(f"data: {record.file}: {record.where}: {bad.detail}; skipped "
                        "(data.on_bad_record=skip); further such records of this file are counted, not shown")

    def snapshot(self) -> dict:
        return copy.deepcopy(self.counts)


def merge_counts(*many: dict) -> dict:
    """The sum of several {file: {reason: n}} count dicts."""
    total: dict[str, dict[str, int]] = {}
    for counts in many:
        for file, reasons in counts.items():
            for reason, n in reasons.items():
                total.setdefault(file, {})[reason] = total.get(file, {}).get(reason, 0) + n
    return total


def decode(raw: bytes, encoding: str) -> str | Bad:
    """`raw` as text in `encoding` (strict), or why it is not text."""
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as e:
        if b"\x00" in raw:
            return Bad("binary", "binary data (NUL bytes)")
        return Bad("undecodable", f"not valid {encoding} at byte {e.start}{ENCODING_HINT}")
    return text


def checked_text(value, field: str) -> str | Bad:
    """A record's text field, or why it is not usable text."""
    if not isinstance(value, str):
        what = "missing" if value is None else f"a {type(value).__name__}, not text"
        return Bad("no_text", f"the text field {field!r} is {what}")
    if "\x00" in value:
        return Bad("binary", "binary data (NUL bytes)")
    return value


def records(src: SourceSpec, stream: int, streams: int, pos: dict | None = None,
            reader: Reader | None = None) -> Iterator[Record]:
    """The records of `stream` (of `streams`) from position `pos` on (None: the start), in reading order.
    Files are opened, and a dataset on the Hub is read, through `reader` (train/data/reading.py: retries;
    None: no retry of a file, and huggingface_hub's own retries of the Hub's requests)."""
    read = {"text": _text_records, "docstrings": _docstring_records, "json": _json_records,
            "parquet": _parquet_records, "hub": _hub_records}
    if src.reader not in read:
        raise ValueError(f"records: {src.reader} sources hold tokens, not records")
    return read[src.reader](src, stream, streams, pos, reader if src.reader == "hub" else reader or Reader())


def _text_records(src, stream, streams, pos, reader):
    """One document per file: file f is record f; only this stream's files are opened. With
    src.piece_chars > 0 a longer file is cut into pieces (train/data/pieces.py): piece k of file f is
    record f + k, so every file that may be longer than piece_chars is opened by every stream."""
    first_file, first_piece = (pos["file"], pos.get("piece", 0)) if pos else (0, 0)
    for f in range(first_file, len(src.files)):
        may_cut = src.piece_chars > 0 and reader.size(src.files[f]) > src.piece_chars  # chars ≤ bytes
        if not may_cut and f % streams != stream:
            continue
        raw = reader.read_bytes(src.files[f])
        text = decode(raw, src.encoding)
        if isinstance(text, Bad) or not may_cut:
            if f % streams == stream and (f, 0) >= (first_file, first_piece):
                yield Record({"file": f, "piece": 0}, f, src.files[f], "the file",
                             text if isinstance(text, Bad) else checked_text(text, "text"))
            continue
        texts = pieces.cut(text, src.piece_chars)
        validation_from = len(texts) - pieces.held_out(len(texts), src.val_permille)
        for k, piece in enumerate(texts):
            if (f + k) % streams == stream and (f, k) >= (first_file, first_piece):
                held = validation_from <= k if len(texts) > 1 else None
                yield Record({"file": f, "piece": k}, f + k, src.files[f], f"piece {k + 1} of {len(texts)}",
                             checked_text(piece, "text"), held)


def _docstring_records(src, stream, streams, pos, reader):
    """One document per .py file, the prose of its docstrings (train/data/docstrings.py): file f is record
    f; only this stream's files are opened. A file that is not Python is a bad record (not_python)."""
    for f in range(pos["file"] if pos else 0, len(src.files)):
        if f % streams != stream:
            continue
        text = decode(reader.read_bytes(src.files[f]), src.encoding)
        if not isinstance(text, Bad):
            try:
                text = docstrings.prose(text)
            except (SyntaxError, ValueError) as err:  # ValueError: a NUL byte in the source
                text = Bad("not_python", f"not Python source ({err})")
        yield Record({"file": f, "piece": 0}, f, src.files[f], "the file",
                     text if isinstance(text, Bad) else checked_text(text, "text"))


def _json_records(src, stream, streams, pos, reader):
    """JSON lines (one object per non-blank line), or a JSON array of objects, per file."""
    pos = pos or {"file": 0, "byte": 0, "line": 0, "index": 0}
    index = pos["index"]
    for f in range(pos["file"], len(src.files)):
        path = src.files[f]
        start = pos if f == pos["file"] else {"byte": 0, "line": 0}
        with reader.call(path, _open_binary) as fh:
            if _is_json_array(fh):
                index = yield from _json_array_records(src, fh, f, index, start["line"], stream, streams)
                continue
            fh.seek(start["byte"])
            byte, line = start["byte"], start["line"]
            for raw in fh:
                here, byte, line = byte, byte + len(raw), line + 1
                if not raw.strip():
                    continue
                if index % streams == stream:
                    at = {"file": f, "byte": here, "line": line - 1, "index": index}
                    yield Record(at, index, path, f"line {line}", _json_text(raw, src))
                index += 1


def _open_binary(path: str):
    return open(path, "rb")


def _is_json_array(fh) -> bool:
    head = fh.read(64).lstrip()
    fh.seek(0)
    return head[:1] == b"["


def _json_array_records(src, fh, f, index, first, stream, streams):
    """Records of a file holding one JSON array; returns the index after its last record."""
    path = src.files[f]
    text = decode(fh.read(), src.encoding)
    items = text
    if not isinstance(text, Bad):
        try:
            items = json.loads(text)
        except ValueError as e:
            items = Bad("not_json", f"not a JSON array ({e})")
    if isinstance(items, Bad):  # the whole file is one bad record
        if first == 0 and index % streams == stream:
            yield Record({"file": f, "byte": 0, "line": 0, "index": index}, index, path, "the file", items)
        return index + 1
    for k in range(first, len(items)):
        if (index + k - first) % streams == stream:
            item = items[k]
            value = item.get(src.text_field) if isinstance(item, dict) else None
            text = checked_text(value, src.text_field) if isinstance(item, dict) else Bad("not_json", "not a JSON object")
            yield Record({"file": f, "byte": 0, "line": k, "index": index + k - first}, index + k - first, path,
                         f"record {k + 1}", text)
    return index + len(items) - first


def _json_text(raw: bytes, src: SourceSpec) -> str | Bad:
    """The text field of one JSON line."""
    text = decode(raw, src.encoding)
    if isinstance(text, Bad):
        return text
    try:
        obj = json.loads(text)
    except ValueError as e:
        return Bad("not_json", f"not JSON ({e})")
    if not isinstance(obj, dict):
        return Bad("not_json", f"a JSON {type(obj).__name__}, not an object")
    return checked_text(obj.get(src.text_field), src.text_field)


def _parquet_records(src, stream, streams, pos, reader):
    """Rows of parquet files, by row group; only the text column is read, only this stream's rows converted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pos = pos or {"file": 0, "row": 0, "index": 0}
    index = pos["index"] - pos["row"]  # the index of the first row of file pos["file"]
    for f in range(pos["file"], len(src.files)):
        path = src.files[f]
        meta = reader.call(path, pq.ParquetFile)
        start = pos["row"] if f == pos["file"] else 0
        has_field = src.text_field in meta.schema_arrow.names
        row0 = 0
        for g in range(meta.num_row_groups):
            n = meta.metadata.row_group(g).num_rows
            if row0 + n <= start:
                row0 += n
                continue
            first = max(start - row0, 0)
            first += (stream - (index + row0 + first)) % streams
            rows = range(first, n, streams)
            if len(rows):
                values = (meta.read_row_group(g, columns=[src.text_field]).column(0).take(pa.array(rows)).to_pylist()
                          if has_field else [None] * len(rows))
                for r, value in zip(rows, values):
                    i = index + row0 + r
                    yield Record({"file": f, "row": row0 + r, "index": i}, i, path, f"row {row0 + r + 1}",
                                 checked_text(value, src.text_field))
            row0 += n
        index += meta.metadata.num_rows


def _hub_records(src, stream, streams, pos, reader):
    """A `datasets` stream (a Hub name, a local dataset folder or a cached dataset); positions hold datasets'
    own state. `datasets` reads the files itself; from the Hub its requests go through `reader`
    (train/data/hub_client.py), and one that stays unanswered is DataUnavailable naming its URL. With at
    least `streams` data files, stream j is datasets' shard j of `streams` (files j, j+S, j+2S, …) and its
    records are numbered within it; with fewer, every stream reads all records in order and keeps record i
    when i mod S = j."""
    dataset = open_hub(src, reader)
    files = dataset.n_shards
    pos = pos or {"state": None, "index": 0, "files": files}
    if pos["files"] != files:
        raise DataError(
            f"data: {src.name!r} now has {files} data file(s); the resume state was saved when it had {pos['files']} "
            "(streams are sets of files, so the order changed): restore the files, or start a new run"
        )
    label = f"{src.name}[{src.split}]"
    if by_files(files, streams):
        dataset = dataset.shard(num_shards=streams, index=stream, contiguous=False)
        label, stream, streams = f"{label} stream {stream}", 0, 1
    if pos["state"] is not None:
        dataset.load_state_dict(pos["state"])
    index, before = pos["index"], pos["state"]
    with _unreachable_as_data_unavailable():
        for record in dataset:
            if index % streams == stream:
                yield Record({"state": before, "index": index, "files": files}, index, label, f"record {index + 1}",
                             checked_text(record.get(src.text_field), src.text_field))
            index += 1
            if index % streams == stream:
                before = dataset.state_dict()


def by_files(files: int, streams: int) -> bool:
    """Whether a `datasets` source of `files` data files is split into `streams` streams by file (else by record)."""
    return files >= streams


def open_hub(src: SourceSpec, reader: Reader | None = None):
    """The dataset of `src` as a streaming `datasets.IterableDataset`, in its fixed order (files in order). A
    dataset on the Hub is read through `reader` (train/data/hub_client.py; None: as huggingface_hub reads)."""
    import datasets

    from train.data import hub_client  # (huggingface_hub: imported by a run that streams from the Hub only)

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if reader is not None and hub_location(src.name) == "network":
        hub_client.use(reader)
    with _unreachable_as_data_unavailable():
        try:
            return datasets.load_dataset(src.name, src.config_name, split=src.split, streaming=True)
        except (ConnectionError, OSError, ValueError) as e:
            if hub_client.unreachable(e) is not None:
                raise
            valid = ("a local dataset folder, or a dataset already in the local datasets cache (offline mode is on)"
                     if hub_offline() else "a Hub dataset or a local dataset folder")
            raise DataError(f"data.source=hub: cannot open data.name={src.name!r} ({e}); it must be {valid}") from e


@contextlib.contextmanager
def _unreachable_as_data_unavailable():
    """A Hub request that stayed unanswered, in whatever error `datasets` raised around it, as its
    DataUnavailable (train/data/hub_client.py)."""
    from train.data import hub_client

    try:
        yield
    except Exception as err:
        gone = hub_client.unreachable(err)
        if gone is None:
            raise
        raise gone from None


def is_validation(text: str, val_permille: int) -> bool:
    """The held-out split, per document by a stable hash of its text (so independent of order)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % 1000 < val_permille


def in_validation(record: Record, val_permille: int) -> bool:
    """Whether a record with text is held out: a piece of a cut document by its place (train/data/pieces.py),
    any other document by is_validation."""
    return record.held_out if record.held_out is not None else is_validation(record.text, val_permille)


def documents(
    src: SourceSpec, stream: int, streams: int, validation: bool, bad: BadRecords,
    cursor: dict | None = None, repeat: bool = False, reader: Reader | None = None,
) -> Iterator[tuple[dict, np.ndarray]]:
    """Yield (cursor, tokens) for each document of one split of one stream, from `cursor` on (None: the start),
    its files opened through `reader` (None: no retry).

    tokens: int32 array, the document's GPT-2 tokens then `<|endoftext|>`, from the cursor's token offset.
    cursor: {"epoch", "at": the record's position (None: the epoch's start), "offset": tokens of the document
    already used}. While a document is being yielded, `bad` holds the counts of bad records before it.
    repeat: after the last document start the next epoch (the same documents again), forever.
    """
    cursor = cursor or {"epoch": 0, "at": None, "offset": 0}
    epoch, at, offset = cursor["epoch"], cursor["at"], cursor["offset"]
    read = _prepared_documents if src.reader == "prepared" else _text_documents
    while True:
        kept = 0
        for pos, tokens in read(src, stream, streams, at, validation, bad, reader):
            kept += 1
            yield {"epoch": epoch, "at": pos, "offset": offset}, tokens[offset:]
            offset = 0
        if not repeat:
            return
        if at is None and kept == 0:
            split = "validation" if validation else "training"
            raise DataError(f"data: {src.label}: stream {stream} of data.streams={streams} has no {split} documents")
        epoch, at = epoch + 1, None


def place(record: Record) -> tuple[int, int]:
    """Where a record of a local source is: (file, its piece, line or row in the file), in reading order."""
    pos = record.pos
    return pos["file"], pos.get("piece", pos.get("line", pos.get("row", 0)))


def tokens_of(text: str) -> list[int]:
    """A document's GPT-2 tokens, then <|endoftext|>: what it adds to its split's token stream."""
    ids = gpt2().encode_ordinary(text)
    ids.append(EOT)
    return ids


def _text_documents(src, stream, streams, at, validation, bad, reader):
    for record in records(src, stream, streams, at, reader):
        if isinstance(record.text, Bad):
            bad.skip(record)
        elif record.text and src.val_tail is not None:
            ids = _tail_split(record, src.val_tail, validation)
            if ids is not None:
                yield record.pos, np.array(ids, dtype=np.int32)
        elif record.text and in_validation(record, src.val_permille) == validation:
            yield record.pos, np.array(tokens_of(record.text), dtype=np.int32)


def _tail_split(record: Record, tail: tuple[int, int, int], validation: bool) -> list[int] | None:
    """A record's tokens in one split when the source's validation is its tail (SourceSpec.val_tail: from
    token `offset` of the record at (file, within) on): the records before it train, those after it validate,
    and the record itself is cut there, its training part closed by <|endoftext|>. None: none in this split."""
    here, (file, within, offset) = place(record), tail
    if here != (file, within):
        return None if (here > (file, within)) != validation else tokens_of(record.text)
    ids = tokens_of(record.text)
    if validation:
        return ids[offset:]
    return [*ids[:offset], EOT] if offset else None


def _prepared_documents(src, stream, streams, at, validation, bad, reader):
    """Token rows of a prepared split whose document index is this stream's; positions are row numbers
    (memory-mapped by `datasets`: `reader` is not used)."""
    split = prepared_split(src.path, "validation" if validation else "train")
    rows = split.rows_of(stream, streams)
    start = int(np.searchsorted(rows, at["row"])) if at else 0
    for b in range(start, len(rows), TOKEN_BLOCK):
        block = rows[b : b + TOKEN_BLOCK]
        for row, tokens in zip(block, split.tokens(block)):
            yield {"row": int(row)}, tokens


class PreparedSplit:
    """One split of a prepared dataset, memory-mapped: a `doc` column (record index) and a `tokens` column."""

    def __init__(self, path: str, split: str):
        import datasets

        datasets.disable_progress_bars()
        self.table = datasets.load_from_disk(path)[split].data  # memory-mapped Arrow table
        self.docs = self.table.column("doc").to_numpy()  # (rows,) int64, increasing

    def rows_of(self, stream: int, streams: int) -> np.ndarray:
        return np.flatnonzero(self.docs % streams == stream)

    def tokens(self, rows: np.ndarray) -> list[np.ndarray]:
        """The token arrays (each int32, ending in <|endoftext|>) of `rows`."""
        column = self.table.column("tokens").take(rows)  # ChunkedArray of list<int32>
        out = []
        for chunk in column.chunks:
            offsets, values = chunk.offsets.to_numpy(), chunk.values.to_numpy()
            out += [values[offsets[k] : offsets[k + 1]] for k in range(len(chunk))]
        return out


@functools.lru_cache(maxsize=8)
def prepared_split(path: str, split: str) -> PreparedSplit:
    """A prepared split, opened once per process (the columns are memory-mapped, not copied)."""
    if not os.path.isdir(os.path.join(path, split)):
        raise DataError(f"data.path={path!r} has no {split!r} split")
    return PreparedSplit(path, split)
