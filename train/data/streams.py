"""Streams of windows: one lane's documents packed and shuffled, and the mixture's choice of lane.

A *lane* is stream s of source j (a single-source run has one source, j = 0). Its documents
(`data_records.documents`) are concatenated into one token stream, cut into consecutive windows of
``seq_len + 1`` tokens, and served in chunks of ``B = shuffle_buffer / streams`` windows; chunk c is
emitted in the order of a permutation drawn from a generator seeded by (seed, j, s, c). Concatenated,
the unpermuted windows are the lane's token stream again: no token is dropped or repeated.

With a mixture, position t of stream s is fed by source j with probability w_j, drawn by a generator
seeded by (seed, s, t // SCHEDULE_BLOCK) — independent of dp, of timing and of what was read, so any
rank can count how many windows every source has supplied without reading a document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from train.data.reading import Reader
from train.data.records import BadRecords, documents
from train.data.sources import DataSpec

SCHEDULE_BLOCK = 4096  # mixture positions drawn at a time
MIXTURE_KEY = 0x6D6978  # keeps the mixture's generators apart from the chunk permutations


def pack(docs: Iterator, window: int, n: int, bad: BadRecords | None = None) -> Iterator[tuple[np.ndarray, dict, dict]]:
    """Cut the concatenated tokens of `docs` into chunks of `n` consecutive windows of `window` tokens.

    docs: (cursor, tokens) pairs as `data_records.documents` yields them.
    Yields (chunk, cursor, counts): chunk is (n, window) int32; cursor is where the stream continues after
    it; counts are `bad`'s counts of bad records before that cursor's document ({} without `bad`).
    A final partial chunk is dropped (the repeating training stream never has one).
    """
    need = n * window
    parts, have = [], 0
    for cursor, tokens in docs:
        used = 0
        while have + len(tokens) - used >= need:
            parts.append(tokens[used : used + need - have])
            used += need - have
            end = {**cursor, "offset": cursor["offset"] + used}
            yield np.concatenate(parts).reshape(n, window), end, bad.snapshot() if bad else {}  # (n, T+1)
            parts, have = [], 0
        if used < len(tokens):
            parts.append(tokens[used:])
            have += len(tokens) - used


@dataclass
class Chunk:
    """Chunk `index` of one lane: its permuted windows and where the lane stands after it."""

    index: int
    windows: np.ndarray  # (B, T+1) int32, permuted
    end: dict  # the lane's cursor after this chunk
    end_counts: dict  # bad records counted before that cursor
    retries: int = 0  # reads retried while packing it (train/data/reading.py)


@dataclass
class LaneState:
    """Where one lane stands: windows served from it, and the cursor and bad-record counts at the start of
    its chunk ``served // B`` (the chunk that the next window comes from)."""

    served: int = 0
    cursor: dict | None = None
    counts: dict | None = None

    def as_dict(self) -> dict:
        return {"served": self.served, "cursor": self.cursor, "counts": self.counts or {}}


class LanePacker:
    """Lane (source j, stream s) from a `LaneState` on: `next_chunk()` gives its chunks in order, its data read
    through `reader` (the lanes one process packs share one: a process's Hub requests go through one)."""

    def __init__(self, spec: DataSpec, lane: tuple[int, int], seq_len: int, seed: int, state: LaneState,
                 reader: Reader, warn: bool = True, warned: set | None = None):
        j, s = lane
        self.key, self.size = (seed, j, s), spec.chunk_windows
        self.index = state.served // self.size
        self.bad = BadRecords(spec.on_bad_record, warn, state.counts, warned)
        self.reader = reader
        docs = documents(spec.sources[j], s, spec.streams, validation=False, bad=self.bad, cursor=state.cursor,
                         repeat=True, reader=self.reader)
        self._chunks = pack(docs, seq_len + 1, self.size, self.bad)

    def next_chunk(self) -> Chunk:
        """The lane's next chunk, with the reads retried while packing it (lanes are packed one at a time, so
        they are this lane's); DataUnavailable when data it needs stays unreadable."""
        retried = self.reader.made
        windows, end, counts = next(self._chunks)  # (B, T+1)
        order = np.random.default_rng([*self.key, self.index]).permutation(self.size)
        chunk = Chunk(self.index, windows[order], end, counts, self.reader.made - retried)
        self.index += 1
        return chunk


class Schedule:
    """Which source feeds each position of each stream (all zeros for a single source)."""

    def __init__(self, weights: tuple[float, ...], seed: int):
        self.weights, self.seed = np.asarray(weights, dtype=np.float64), seed
        self._block: dict[int, tuple[int, np.ndarray]] = {}  # stream → (block number, its draws), the last used

    def _draws(self, s: int, block: int) -> np.ndarray:
        cached = self._block.get(s)
        if cached is None or cached[0] != block:
            rng = np.random.default_rng([self.seed, MIXTURE_KEY, s, block])
            cached = (block, rng.choice(len(self.weights), size=SCHEDULE_BLOCK, p=self.weights).astype(np.int64))
            self._block[s] = cached
        return cached[1]

    def sources(self, s: int, t0: int, t1: int) -> np.ndarray:
        """The source index of positions [t0, t1) of stream s, (t1 - t0,) int64."""
        if len(self.weights) == 1:
            return np.zeros(t1 - t0, dtype=np.int64)
        parts, t = [], t0
        while t < t1:
            block, off = divmod(t, SCHEDULE_BLOCK)
            k = min(t1 - t, SCHEDULE_BLOCK - off)
            parts.append(self._draws(s, block)[off : off + k])
            t += k
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def counts(self, s: int, t0: int, t1: int) -> np.ndarray:
        """Windows each source supplies to positions [t0, t1) of stream s, (J,) int64."""
        return np.bincount(self.sources(s, t0, t1), minlength=len(self.weights))
