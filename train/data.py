"""Training and validation batches: documents → GPT-2 tokens → packed windows → one global order.

The pipeline (documents come from `train.data_sources`):

1. every document becomes its GPT-2 tokens followed by `<|endoftext|>`, all concatenated into one
   token stream;
2. the stream is cut into consecutive, non-overlapping windows of ``seq_len + 1`` tokens (inputs are
   ``window[:-1]``, targets ``window[1:]``); concatenated, the windows are the stream again;
3. windows are shuffled chunk by chunk: chunk c (``shuffle_buffer`` consecutive windows) is emitted in
   the order of a permutation drawn from a generator seeded by (seed, c);
4. global batch k is the next ``global_batch`` windows of that order, and data-parallel rank r of dp
   takes rows [r·G/dp, (r+1)·G/dp) of it. Every rank packs the same stream, so global batch k is the
   same set of windows at any dp, and a run can resume on a different number of ranks.

Documents are split between training and validation by a hash of their text
(`data_sources.is_validation`), so the two never share a document. The training stream repeats
(epoch after epoch) and never runs out; validation reads its split once, unshuffled.

`TrainBatches.state_dict()` is the stream position at the start of the current chunk (datasets' own
document position plus a token offset) and the number of windows served; resuming re-packs at most
that one chunk and gives the identical next batch.
"""

from __future__ import annotations

import copy
from itertools import islice
from typing import Iterator

import numpy as np
import torch

from train.data_sources import DataError, check_data_config, documents, resolve

__all__ = ["DataError", "check_data_config", "TrainBatches", "validation_batches", "pack"]

STATE_VERSION = 1


def pack(docs: Iterator, window: int, n: int) -> Iterator[tuple[np.ndarray, dict]]:
    """Cut the concatenated tokens of `docs` into chunks of `n` consecutive windows of `window` tokens.

    docs: (cursor, tokens) pairs as `data_sources.documents` yields them.
    Yields (chunk, cursor): chunk is (n, window) int32; cursor is where the stream continues after it.
    A final partial chunk is dropped (the repeating training stream never has one).
    """
    need = n * window
    parts, have = [], 0
    for cursor, tokens in docs:
        used = 0
        while have + len(tokens) - used >= need:
            parts.append(tokens[used : used + need - have])
            used += need - have
            yield np.concatenate(parts).reshape(n, window), {**cursor, "offset": cursor["offset"] + used}  # (n, T+1)
            parts, have = [], 0
        if used < len(tokens):
            parts.append(tokens[used:])
            have += len(tokens) - used


def _check_layout(seq_len: int, batch: int, dp_rank: int, dp_size: int) -> None:
    """Reject window and batch shapes that cannot be served evenly to every data-parallel rank."""
    if seq_len < 1 or batch < 1:
        raise DataError(f"data: seq_len={seq_len} and batch={batch} must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"data: dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
    if batch % dp_size:
        raise DataError(
            f"data: a global batch of {batch} windows does not split evenly over {dp_size} data-parallel ranks"
        )


def _rank_rows(windows: np.ndarray, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch, as int64."""
    per = len(windows) // dp_size
    return torch.from_numpy(windows[dp_rank * per : (dp_rank + 1) * per].astype(np.int64))  # (G/dp, T+1)


class TrainBatches:
    """This rank's training batches, in the global order; `next(it)` → LongTensor (G/dp, seq_len + 1).

    Construction is cheap (the config is checked, nothing is read); the stream opens on the first batch.
    `global_batch` may be changed between batches (a batch-size ramp); positions count windows, so the
    order and the resume state do not depend on it, nor on dp.
    """

    def __init__(self, data_cfg, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        _check_layout(seq_len, global_batch, dp_rank, dp_size)
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"data: seed={seed!r} must be a non-negative int")
        self.spec = resolve(data_cfg)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._cursor = {"epoch": 0, "docs": None, "offset": 0}  # stream position at the start of chunk pos // B
        self._pos = 0  # windows of the global order served so far
        self._chunks = None  # live packer, continuing from _cursor
        self._chunk = None  # (permuted windows (B, T+1), cursor after them) of chunk pos // B, once packed

    @property
    def windows_served(self) -> int:
        """Windows served so far, over all ranks."""
        return self._pos

    @property
    def tokens_served(self) -> int:
        """Tokens trained on so far, over all ranks (seq_len predictions per window)."""
        return self._pos * self.seq_len

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch(self.global_batch)

    def next_batch(self, global_batch: int) -> torch.Tensor:
        """The next `global_batch` windows of the global order; this rank's rows, (global_batch // dp, T+1)."""
        _check_layout(self.seq_len, global_batch, self.dp_rank, self.dp_size)
        return _rank_rows(self._take(global_batch), self.dp_rank, self.dp_size)

    def _take(self, n: int) -> np.ndarray:
        """The next n windows of the global order, (n, T+1) int32."""
        size = self.spec.shuffle_buffer
        parts = []
        while n:
            if self._chunk is None:
                if self._chunks is None:
                    docs = documents(self.spec, validation=False, cursor=self._cursor, repeat=True)
                    self._chunks = pack(docs, self.seq_len + 1, size)
                windows, end = next(self._chunks)  # (B, T+1)
                order = np.random.default_rng([self.seed, self._pos // size]).permutation(size)
                self._chunk = (windows[order], end)
            start = self._pos % size
            k = min(n, size - start)
            parts.append(self._chunk[0][start : start + k])  # (k, T+1)
            self._pos, n = self._pos + k, n - k
            if self._pos % size == 0:
                self._cursor, self._chunk = self._chunk[1], None
        return np.concatenate(parts)  # (n, T+1)

    def _stream_id(self) -> dict:
        return {**self.spec.fingerprint(), "seq_len": self.seq_len, "seed": self.seed}

    def state_dict(self) -> dict:
        """Where the global order stands: plain ints/strings/dicts, independent of dp and global_batch."""
        return {
            "version": STATE_VERSION,
            "stream": self._stream_id(),
            "cursor": copy.deepcopy(self._cursor),
            "windows_served": self._pos,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: the next batch is the one that followed when it was saved."""
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data: resume state has version {state.get('version')!r}, expected {STATE_VERSION}")
        mine, theirs = self._stream_id(), state["stream"]
        changed = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if changed:
            raise DataError(f"data: the resume state is for another stream; changed (then, now): {changed}")
        self._cursor = copy.deepcopy(state["cursor"])
        self._pos = state["windows_served"]
        self._chunks = self._chunk = None


def validation_batches(
    data_cfg, seq_len: int, batch: int, n_batches: int, dp_rank: int, dp_size: int
) -> list[torch.Tensor]:
    """The first n_batches·batch windows of the validation split, unshuffled; each global batch of
    `batch` windows sliced by dp rank as in training. Each tensor: LongTensor (batch // dp, seq_len + 1)."""
    _check_layout(seq_len, batch, dp_rank, dp_size)
    spec = resolve(data_cfg)
    need = n_batches * batch
    windows = [w for w, _ in islice(pack(documents(spec, validation=True), seq_len + 1, 1), need)]  # each (1, T+1)
    if len(windows) < need:
        raise DataError(
            f"data: the validation split holds {len(windows)} windows of {seq_len + 1} tokens, fewer than the "
            f"{need} asked for ({n_batches} batches of {batch}); raise data.val_permille or ask for fewer"
        )
    if not need:
        return []
    windows = np.concatenate(windows)  # (n·batch, T+1)
    return [_rank_rows(windows[k * batch : (k + 1) * batch], dp_rank, dp_size) for k in range(n_batches)]
