"""Training and validation batches: documents → GPT-2 tokens → packed windows → one global order.

The global order (independent of dp, of background workers and of batch sizes):

1. record i of a source belongs to stream ``i % data.streams`` (`train.data.records`); a `datasets`
   source with at least data.streams data files is split by file instead: stream j is its files j,
   j + data.streams, j + 2·data.streams, …;
2. each stream of each source — a *lane* — packs its documents into windows of ``seq_len + 1`` tokens
   and shuffles them chunk by chunk (`train.data.streams`);
3. position t of stream s takes the next window of one source's lane: the only source, or, for a
   mixture, one drawn with the sources' weights by a generator seeded by (seed, s, t // block);
4. a global batch of n windows (n a multiple of S = data.streams) takes the next n / S positions of
   every stream, stream 0's first, then stream 1's, and so on.

Data-parallel rank r of dp takes rows [r·n/dp, (r+1)·n/dp) of that batch. When dp divides S these
rows are exactly streams [r·S/dp, (r+1)·S/dp), so a rank reads and tokenizes only its own streams:
work per rank falls as 1/dp while global batch k stays the same windows in the same order. When S
divides dp, the dp/S ranks of one stream each pack it and keep their share. Changing data.streams
changes the order; changing dp, workers or prefetch does not.

Documents are split between training and validation by a hash of their text
(`data_records.is_validation`), so the two never share one. The training stream repeats (epoch
after epoch, per lane) and never runs out; validation reads its split once, unshuffled.

`TrainBatches.state_dict()` holds, for every lane, the windows it has served and its cursor (record
position + token offset) at the start of its current chunk; resuming re-packs at most one chunk per
lane and gives the identical next batch, at any dp.

`TrainBatches.ready(n)` reads the chunks the next batch needs without taking it (the position and the
state stay where they are), so the loop learns of a data file that stays unreadable (DataUnavailable,
train/data/reading.py) before the step's agreement, while every rank can still save a checkpoint.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections.abc import Mapping
from itertools import islice

import numpy as np
import torch

from train.config.sections import DataConfig
from train.data.order import changes, stream_id
from train.data.probe import check_data, check_layout
from train.data.reading import DataUnavailable, Reader
from train.data.records import BadRecords, documents, merge_counts
from train.data.sources import DataError, DataSpec, check_data_config, resolve
from train.data.streams import LaneState, Schedule, pack
from train.data.workers import make_supply

__all__ = ["DataError", "DataUnavailable", "check_data_config", "check_data", "TrainBatches", "validation_batches",
           "pack"]

STATE_VERSION = 2


class TrainBatches:
    """This rank's training batches, in the global order; `next(it)` → LongTensor (G/dp, seq_len + 1).

    Construction is cheap (the config is checked, nothing is read); reading starts with `start()` or
    the first batch. `next_batch(n)` takes any number of windows that data.streams and dp divide, so the
    global batch may change from step to step (a batch-size ramp); positions count windows, so the
    order and the resume state depend on neither the batch sizes nor dp.
    """

    def __init__(self, data_cfg: DataConfig | Mapping | DataSpec, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int,
                 warn: bool = True):
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"data: seed={seed!r} must be a non-negative int")
        self.spec = resolve(data_cfg)
        check_layout(self.spec, seq_len, global_batch, dp_rank, dp_size)
        self.seq_len, self.global_batch, self.seed, self.warn = seq_len, global_batch, seed, warn
        self.dp_rank, self.dp_size = dp_rank, dp_size
        streams = self.spec.streams
        if streams % dp_size == 0:  # whole streams per rank
            per = streams // dp_size
            self.own_streams, self._share = list(range(dp_rank * per, (dp_rank + 1) * per)), None
        else:  # dp_size % streams == 0: ranks share a stream, each keeps its part of it
            share = dp_size // streams
            self.own_streams, self._share = [dp_rank // share], (dp_rank % share, share)
        self.schedule = Schedule(self.spec.weights, seed)
        self._pos = 0  # windows of the global order served so far (all ranks)
        self._source_windows = np.zeros(len(self.spec.sources), dtype=np.int64)  # of those, from each source
        self._lanes = {(j, s): LaneState() for s in self.own_streams for j in range(len(self.spec.sources))}
        self._chunks: dict = {}  # (lane, chunk index) → the chunks fetched and not yet used up, in order per lane
        self._supply = None
        self._wait = 0.0
        self._retries = 0  # reads retried to pack the chunks fetched so far

    # -- reading --------------------------------------------------------------------------------------

    @property
    def windows_served(self) -> int:
        """Windows served so far, over all ranks."""
        return self._pos

    @property
    def tokens_served(self) -> int:
        """Tokens trained on so far, over all ranks (seq_len predictions per window)."""
        return self._pos * self.seq_len

    def start(self) -> None:
        """Start reading (background workers begin packing ahead); the first batch does it otherwise."""
        if self._supply is None:
            self._supply = make_supply(self.spec, self._lanes, self.seq_len, self.seed, self.warn)
            weakref.finalize(self, self._supply.close)  # workers stop with this object, if not closed before

    def close(self) -> None:
        """Stop background workers (a later batch starts them again from the current position)."""
        if self._supply is not None:
            self._supply.close()
            self._supply, self._chunks = None, {}

    def ready(self, global_batch: int) -> None:
        """Fetch every chunk the next `global_batch` windows come from, without taking them: the position and
        state_dict stay as they are, and the next `next_batch(global_batch)` reads nothing. DataUnavailable
        when a file one of them needs stays unreadable."""
        check_layout(self.spec, self.seq_len, global_batch, self.dp_rank, self.dp_size)
        started = time.perf_counter()
        self.start()
        m, t0, size = global_batch // self.spec.streams, self._pos // self.spec.streams, self.spec.chunk_windows
        for s in self.own_streams:
            needed = np.bincount(self.schedule.sources(s, t0, t0 + m), minlength=len(self.spec.sources))
            for j, n in enumerate(needed.tolist()):
                served = self._lanes[(j, s)].served
                for index in range(served // size, (served + n - 1) // size + 1 if n else 0):
                    self._chunk((j, s), index)
        self._wait += time.perf_counter() - started

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch(self.global_batch)

    def next_batch(self, global_batch: int) -> torch.Tensor:
        """The next `global_batch` windows of the global order; this rank's rows, (global_batch // dp, T+1)."""
        check_layout(self.spec, self.seq_len, global_batch, self.dp_rank, self.dp_size)
        started = time.perf_counter()
        self.start()
        m, t0 = global_batch // self.spec.streams, self._pos // self.spec.streams
        rows = []
        for s in self.own_streams:
            windows = self._stream_windows(s, t0, m)  # (m, T+1)
            if self._share is not None:
                part, share = self._share
                windows = windows[part * m // share : (part + 1) * m // share]
            rows.append(windows)
        if self.spec.mixture:  # every stream's draws, owned or not: the shares are global
            for s in range(self.spec.streams):
                self._source_windows += self.schedule.counts(s, t0, t0 + m)
        else:
            self._source_windows[0] += global_batch
        self._pos += global_batch
        batch = torch.from_numpy(np.concatenate(rows).astype(np.int64))  # (G/dp, T+1)
        self._wait += time.perf_counter() - started
        return batch

    def _stream_windows(self, s: int, t0: int, m: int) -> np.ndarray:
        """Positions [t0, t0 + m) of stream s, (m, T+1) int32."""
        sources = self.schedule.sources(s, t0, t0 + m)
        parts, k = [], 0
        while k < m:  # runs of positions fed by one source
            end = k + 1
            while end < m and sources[end] == sources[k]:
                end += 1
            parts.append(self._take((int(sources[k]), s), end - k))
            k = end
        return np.concatenate(parts)

    def _take(self, lane: tuple[int, int], n: int) -> np.ndarray:
        """The next n windows of one lane, (n, T+1) int32."""
        state, size, parts = self._lanes[lane], self.spec.chunk_windows, []
        while n:
            index, offset = divmod(state.served, size)
            chunk = self._chunk(lane, index)
            k = min(n, size - offset)
            parts.append(chunk.windows[offset : offset + k])
            state.served, n = state.served + k, n - k
            if state.served % size == 0:
                state.cursor, state.counts = chunk.end, chunk.end_counts
                del self._chunks[(lane, index)]
        return np.concatenate(parts)

    def _chunk(self, lane: tuple[int, int], index: int):
        """Chunk `index` of a lane, fetched from the supply unless it was already (the supply hands out each
        lane's chunks in order, and they are asked for in order)."""
        chunk = self._chunks.get((lane, index))
        if chunk is None:
            chunk = self._chunks[(lane, index)] = self._supply.get(lane, index)
            self._retries += chunk.retries
        return chunk

    # -- what the loop logs ---------------------------------------------------------------------------

    @property
    def read_retries(self) -> int:
        """Reads of data files retried so far by this process (train/data/reading.py), for the chunks it took."""
        return self._retries

    def pop_wait_seconds(self) -> float:
        """Seconds spent inside next_batch since the last call (the step's wait for data), then reset."""
        wait, self._wait = self._wait, 0.0
        return wait

    def mixture_shares(self) -> dict[str, float]:
        """Share of the windows served so far that came from each source, by name (global: every rank
        computes it from the seeded schedule, no communication)."""
        total = max(self._pos, 1)
        return {src.label: int(n) / total for src, n in zip(self.spec.sources, self._source_windows)}

    def bad_records(self, gather: bool = False) -> dict:
        """Bad records skipped so far, {file: {reason: count}}: this rank's streams, or with gather=True
        every stream's (a collective when ranks read different streams: call it on every rank)."""
        size = self.spec.chunk_windows
        current = {lane: self._chunks.get((lane, st.served // size)) for lane, st in self._lanes.items()}
        counts = {f"{j}/{s}": (current[(j, s)].end_counts if current[(j, s)] is not None else st.counts or {})
                  for (j, s), st in self._lanes.items()}
        if gather:
            counts = _union(self._gather(counts))
        return merge_counts(*counts.values())

    # -- resume ---------------------------------------------------------------------------------------

    def _stream_id(self) -> dict:
        return stream_id(self.spec, self.seq_len, self.seed)

    def local_state_dict(self) -> dict:
        """This rank's part of the state: the position and its own lanes."""
        return copy.deepcopy({
            "version": STATE_VERSION,
            "stream": self._stream_id(),
            "windows_served": self._pos,
            "source_windows": [int(n) for n in self._source_windows],
            "lanes": {f"{j}/{s}": st.as_dict() for (j, s), st in sorted(self._lanes.items())},
        })

    def state_dict(self) -> dict:
        """Where the global order stands, for every lane: plain ints/strings/dicts, independent of dp.

        When ranks read different streams (dp > 1 and data.streams > 1) under torch.distributed, this
        gathers every rank's lanes: a collective, so every rank calls it (as checkpoint saving does)."""
        local = self.local_state_dict()
        states = self._gather(local)
        if any(st["windows_served"] != self._pos for st in states):
            raise DataError(f"data: ranks disagree on the windows served: {[st['windows_served'] for st in states]}")
        return {**local, "lanes": _union([st["lanes"] for st in states])}

    def _gather(self, obj) -> list:
        """`obj` from every rank, when ranks read different streams; else [obj]."""
        import torch.distributed as dist

        if self.dp_size == 1 or self.spec.streams == 1 or not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (saved at any dp): the next batch is the one that followed when it was saved."""
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"data: the resume state has version {state.get('version')!r}; this gpt3d reads version {STATE_VERSION} "
                "(resume with the gpt3d that saved it, or start a new run)"
            )
        changed = changes(state["stream"], self._stream_id())
        if changed:
            raise DataError(f"data: the resume state is for other data: {'; '.join(changed)}")
        pos = state["windows_served"]
        # windows each source gave each of this rank's streams so far: (J,) per stream, counted once
        served = {s: self.schedule.counts(s, 0, pos // self.spec.streams) for s in {s for _, s in self._lanes}}
        lanes = {}
        for j, s in self._lanes:
            saved = state["lanes"].get(f"{j}/{s}")
            if saved is None:
                raise DataError(f"data: the resume state lacks lane {j}/{s} (it holds {sorted(state['lanes'])})")
            expected = int(served[s][j])
            if saved["served"] != expected:
                raise DataError(f"data: lane {j}/{s} served {saved['served']} windows, the schedule says {expected}")
            lanes[(j, s)] = LaneState(saved["served"], copy.deepcopy(saved["cursor"]), copy.deepcopy(saved["counts"]))
        self.close()
        self._pos, self._lanes = pos, lanes
        self._source_windows = np.asarray(state["source_windows"], dtype=np.int64)


def _union(dicts: list[dict]) -> dict:
    """One dict of all keys (ranks reading the same lane hold the same value for it)."""
    out = {}
    for d in dicts:
        out.update(d)
    return out


def validation_batches(
    data_cfg: DataConfig | Mapping | DataSpec, seq_len: int, batch: int, n_batches: int, dp_rank: int, dp_size: int
) -> list[torch.Tensor]:
    """The first n_batches·batch windows of the validation split, unshuffled; each global batch of
    `batch` windows sliced by dp rank as in training. Each tensor: LongTensor (batch // dp, seq_len + 1).
    `data_cfg` may be the probe's DataSpec (train/data/probe.py), whose tails are cut to hold them.

    A mixture takes from each source its weight's share of the windows (largest remainders), the first
    ones of its split, interleaved evenly."""
    spec = resolve(data_cfg)
    if seq_len < 1 or batch < 1 or batch % dp_size or not 0 <= dp_rank < dp_size:
        raise DataError(f"data: validation batches of {batch} windows cannot be split over dp={dp_size} (rank {dp_rank})")
    need = n_batches * batch
    if not need:
        return []
    counts = spec.val_shares(need)
    keyed = []
    reader = Reader.of(spec)
    for src, count in zip(spec.sources, counts):
        bad = BadRecords(spec.on_bad_record, warn=False)  # training reports the bad records; this is a prefix
        docs = documents(src, 0, 1, validation=True, bad=bad, reader=reader)
        got = [w for w, _, _ in islice(pack(docs, seq_len + 1, 1), count)]  # each (1, T+1)
        if len(got) < count:
            raise DataError(
                f"data: {src.label}: the validation split holds {len(got)} windows of {seq_len + 1} tokens, fewer than "
                f"the {count} asked for ({n_batches} batches of {batch}); raise data.val_permille, or lower "
                f"train.eval_batches (or set train.eval_interval=0)"
            )
        keyed += [((k + 0.5) / count, w) for k, w in enumerate(got)]
    keyed.sort(key=lambda item: item[0])  # stable: sources in order at equal keys
    windows = np.concatenate([w for _, w in keyed])  # (n·batch, T+1)
    per = batch // dp_size
    return [
        torch.from_numpy(windows[k * batch + dp_rank * per : k * batch + (dp_rank + 1) * per].astype(np.int64))
        for k in range(n_batches)
    ]
