"""Several streams: global batch k is the same windows in the same order at every dp, each rank reads only
its own streams, background workers change nothing, and a state saved at one dp resumes at another.

The reference for the order is computed here from its definition (record i → stream i mod S; stream-major
batches); the reference for every layout is the one-process (dp=1, workers=0) run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_corpus import files_cfg, take, text_corpus, token_stream
from distributed import run_distributed
from train.data import records as data_records
from train.data import DataError, TrainBatches

SEQ = 16
S = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return text_corpus(tmp_path_factory.mktemp("streams"), 48)


def _cfg(root, **kw):
    return files_cfg(root, **{"streams": S, "shuffle_buffer": 8, "val_permille": 200, **kw})


def test_batches_are_stream_major_slices_of_each_streams_tokens(corpus):
    """Unshuffled (one window per chunk): batch k holds windows [k·m, (k+1)·m) of stream 0, then of stream 1, ...
    where stream s is documents s, s+S, s+2S, ... of the training split, epoch after epoch."""
    root, texts = corpus
    per_stream = [token_stream(texts[s::S], 200) for s in range(S)]
    m, steps = 3, 40  # past the end of the first epoch of the shortest stream
    assert min(len(t) for t in per_stream) < steps * m * (SEQ + 1)
    it = TrainBatches(_cfg(root, shuffle_buffer=S), SEQ, S * m, 0, 1, seed=0)
    for k, batch in enumerate(take(it, steps)):
        for s in range(S):
            reps = np.concatenate([per_stream[s]] * (steps * m * (SEQ + 1) // len(per_stream[s]) + 2))
            want = reps[k * m * (SEQ + 1) : (k + 1) * m * (SEQ + 1)].reshape(m, SEQ + 1)
            assert np.array_equal(batch[s * m : (s + 1) * m].numpy(), want), (k, s)


def _sizes():
    return [8, 4, 8, 16, 8, 8, 12, 8, 8, 4, 16, 8]  # a ramp's changing batch sizes, all multiples of S


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_global_batch_k_is_the_same_at_every_dp(corpus, dp):
    """dp=2, 4 divide S (each rank reads whole streams); dp=8 is a multiple of S (two ranks share a stream).
    The batch size changes from batch to batch, as under a ramp."""
    root, _ = corpus
    sizes = [n for n in _sizes() if n % dp == 0]
    one = TrainBatches(_cfg(root), SEQ, 8, 0, 1, seed=3)
    reference = [one.next_batch(n) for n in sizes]
    ranks = [TrainBatches(_cfg(root), SEQ, 8, r, dp, seed=3) for r in range(dp)]
    for n, want in zip(sizes, reference):
        parts = [it.next_batch(n) for it in ranks]
        assert all(p.shape == (n // dp, SEQ + 1) for p in parts)
        assert torch.equal(torch.cat(parts), want)


def test_a_rank_reads_only_its_own_streams(corpus, monkeypatch):
    """At dp=4 with 4 streams, rank r decodes (and so tokenizes) only files r, r+4, r+8, ..."""
    root, texts = corpus
    opened = []
    real = data_records.decode
    monkeypatch.setattr(data_records, "decode", lambda raw, enc: opened.append(raw) or real(raw, enc))
    for r in range(4):
        opened.clear()
        take(TrainBatches(_cfg(root), SEQ, 8, r, 4, seed=0), 200)  # past an epoch of its streams
        read = {texts.index(raw.decode()) for raw in opened}
        assert read == set(range(r, len(texts), 4))


def test_workers_give_the_same_batches_and_the_same_exact_state(corpus):
    root, _ = corpus
    plain = TrainBatches(_cfg(root), SEQ, 8, 1, 2, seed=4)
    want = [plain.next_batch(n) for n in _sizes()]
    states = []
    for workers, prefetch in ((1, 1), (2, 3)):
        it = TrainBatches(_cfg(root, workers=workers, prefetch=prefetch), SEQ, 8, 1, 2, seed=4)
        try:
            got = [it.next_batch(n) for n in _sizes()]
            states.append(it.state_dict())
        finally:
            it.close()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert states[0] == states[1] == plain.state_dict()


def test_resume_with_workers_continues_exactly(corpus):
    root, _ = corpus
    straight = take(TrainBatches(_cfg(root), SEQ, 8, 0, 1, seed=6), 14)
    first = TrainBatches(_cfg(root, workers=2), SEQ, 8, 0, 1, seed=6)
    try:
        assert all(torch.equal(a, b) for a, b in zip(take(first, 7), straight))
        state = first.state_dict()
    finally:
        first.close()
    again = TrainBatches(_cfg(root, workers=2, prefetch=1), SEQ, 8, 0, 1, seed=6)
    again.load_state_dict(state)
    try:
        assert all(torch.equal(a, b) for a, b in zip(take(again, 7), straight[7:]))
    finally:
        again.close()


def _dp4_rank(root: str, steps: int) -> dict:
    """One rank of dp=4 (a gloo process): its batches and the gathered state after `steps` batches."""
    import torch.distributed as dist

    from pathlib import Path

    it = TrainBatches(_cfg(Path(root)), SEQ, 8, dist.get_rank(), 4, seed=9)
    before = take(it, steps)
    return {"batches": before, "state": it.state_dict(), "local": it.local_state_dict()}


def test_a_dp4_state_resumes_at_dp2_with_the_same_batches(corpus):
    root, _ = corpus
    reference = take(TrainBatches(_cfg(root), SEQ, 8, 0, 1, seed=9), 9)
    results = run_distributed(_dp4_rank, 4, str(root), 5)
    for k in range(5):
        assert torch.equal(torch.cat([r["batches"][k] for r in results]), reference[k])
    state = results[0]["state"]
    assert all(r["state"] == state for r in results)  # gathered: every rank holds every lane
    assert sorted(state["lanes"]) == [f"0/{s}" for s in range(S)]
    assert all(len(r["local"]["lanes"]) == 1 for r in results)  # but each rank read only its own
    dp2 = [TrainBatches(_cfg(root), SEQ, 8, r, 2, seed=9) for r in range(2)]
    for it in dp2:
        it.load_state_dict(state)
    for k in range(5, 9):
        assert torch.equal(torch.cat([it.next_batch(8) for it in dp2]), reference[k])


def test_a_state_missing_lanes_is_refused(corpus):
    root, _ = corpus
    rank0 = TrainBatches(_cfg(root), SEQ, 8, 0, 4, seed=9)
    take(rank0, 2)
    whole = TrainBatches(_cfg(root), SEQ, 8, 0, 1, seed=9)
    with pytest.raises(DataError, match="lacks lane 0/1"):
        whole.load_state_dict(rank0.local_state_dict())


def test_wait_seconds_is_returned_once(corpus):
    root, _ = corpus
    it = TrainBatches(_cfg(root), SEQ, 8, 0, 1, seed=0)
    assert it.pop_wait_seconds() == 0.0
    next(it)
    assert it.pop_wait_seconds() > 0.0
    assert it.pop_wait_seconds() == 0.0


@pytest.mark.parametrize(
    "streams, dp, batch, message",
    [
        (4, 3, 12, "data.streams=4 and data-parallel size 3: one must divide the other"),
        (4, 2, 6, "a global batch of 6 windows is not a multiple of data.streams=4"),
        (4, 1, 8, None),
        (3, 1, 9, "data.shuffle_buffer=8 is not a multiple of data.streams=3"),
    ],
)
def test_impossible_stream_layouts_fail_clearly(corpus, streams, dp, batch, message):
    root, _ = corpus
    make = lambda: TrainBatches(_cfg(root, streams=streams), SEQ, batch, 0, dp, seed=0)
    if message is None:
        make()
    else:
        with pytest.raises(DataError, match=message):
            make()
