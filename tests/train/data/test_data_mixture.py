"""Weighted mixtures: which source fed a window is read off its tokens (the two sources share no token but
<|endoftext|>), so shares, order and content are checked against the corpus, not against the code."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data_corpus import EOT, take, token_stream, write_texts
from train.data import DataError, TrainBatches, validation_batches
from train.data.sources import resolve
from train.data.tokenizer import gpt2

SEQ, S = 16, 2


def _words(i: int) -> str:
    return "apple banana cherry " * (1 + i % 7) + "date " * i


def _digits(i: int) -> str:
    return " ".join(str(d) for d in range(i % 9 + 1)) + " 7" * (3 * i)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Source a: .txt files of words; source b: .jsonl records of digits (field "content")."""
    root = tmp_path_factory.mktemp("mixture")
    a_texts, b_texts = [_words(i) for i in range(30)], [_digits(i) for i in range(40)]
    (root / "a").mkdir()
    write_texts(root / "a", a_texts)
    with open(root / "b.jsonl", "w", encoding="utf-8") as f:
        for text in b_texts:
            f.write(json.dumps({"content": text}) + "\n")
    vocab = lambda texts: {t for text in texts for t in gpt2().encode_ordinary(text)}
    assert not vocab(a_texts) & vocab(b_texts)
    return root, a_texts, b_texts, vocab(a_texts)


def _cfg(root, weights=(3, 1), **kw):
    return {
        "source": "mixture",
        "sources": [
            {"label": "words", "weight": weights[0], "source": "files", "paths": [str(root / "a" / "*.txt")]},
            {"label": "digits", "weight": weights[1], "source": "files", "paths": [str(root / "b.jsonl")],
             "text_field": "content"},
        ],
        "streams": S, "shuffle_buffer": 4, "val_permille": 100, **kw,
    }


def _from_words(window: torch.Tensor, a_vocab: set) -> bool:
    tokens = set(window.tolist()) - {EOT}
    assert tokens and (tokens <= a_vocab or not tokens & a_vocab)
    return tokens <= a_vocab


def test_realised_shares_are_the_windows_each_source_supplied(sources):
    root, _, _, a_vocab = sources
    it = TrainBatches(_cfg(root), SEQ, 8, 0, 1, seed=1)
    windows = torch.cat(take(it, 60))  # (480, T+1)
    words = sum(_from_words(w, a_vocab) for w in windows)
    assert it.mixture_shares() == {"words": words / 480, "digits": (480 - words) / 480}
    assert abs(words / 480 - 0.75) < 0.08  # 4.5 binomial standard deviations


def test_each_sources_windows_arrive_in_its_own_stream_order(sources):
    """Unshuffled: the windows of source x at stream s, in order, are consecutive windows of x's stream s."""
    root, a_texts, b_texts, a_vocab = sources
    it = TrainBatches(_cfg(root, shuffle_buffer=S), SEQ, 2 * S, 0, 1, seed=2)
    batches = take(it, 50)  # (2·S, T+1) each: 2 positions per stream
    for s in range(S):
        got = {True: [], False: []}
        for batch in batches:
            for w in batch[2 * s : 2 * s + 2]:
                got[_from_words(w, a_vocab)].append(w.numpy())
        for is_words, texts in ((True, a_texts), (False, b_texts)):
            stream = np.concatenate([token_stream(texts[s::S], 100)] * 20)
            want = stream[: len(got[is_words]) * (SEQ + 1)].reshape(-1, SEQ + 1)
            assert len(want) > 5 and np.array_equal(np.stack(got[is_words]), want)


def test_mixture_is_deterministic_dp_invariant_and_resumes_exactly(sources):
    root, *_ = sources
    reference = take(TrainBatches(_cfg(root), SEQ, 8, 0, 1, seed=5), 30)
    assert all(torch.equal(a, b) for a, b in zip(take(TrainBatches(_cfg(root), SEQ, 8, 0, 1, seed=5), 30), reference))
    assert not all(torch.equal(a, b) for a, b in zip(take(TrainBatches(_cfg(root), SEQ, 8, 0, 1, seed=6), 30), reference))
    ranks = [TrainBatches(_cfg(root), SEQ, 8, r, 2, seed=5) for r in range(2)]
    for k in range(13):
        assert torch.equal(torch.cat([next(it) for it in ranks]), reference[k])
    state = json.loads(json.dumps(ranks[0].local_state_dict()))  # dp=2 over 2 streams: rank 0 has stream 0 only
    state["lanes"].update(ranks[1].local_state_dict()["lanes"])  # what state_dict() gathers under torch.distributed
    shares = ranks[0].mixture_shares()
    for workers in (0, 2):
        resumed = TrainBatches(_cfg(root, workers=workers), SEQ, 8, 0, 1, seed=5)
        resumed.load_state_dict(state)
        try:
            assert resumed.mixture_shares() == shares
            assert all(torch.equal(a, b) for a, b in zip(take(resumed, 17), reference[13:]))
        finally:
            resumed.close()


def test_validation_takes_each_sources_share_of_its_split(sources):
    root, a_texts, b_texts, a_vocab = sources
    batches = validation_batches(_cfg(root, weights=(2, 1), val_permille=400), SEQ, 3, 4, 0, 1)  # 12 windows: 8 words, 4 digits
    windows = torch.cat(batches)
    words = [w.numpy() for w in windows if _from_words(w, a_vocab)]
    digits = [w.numpy() for w in windows if not _from_words(w, a_vocab)]
    assert (len(words), len(digits)) == (8, 4)
    assert np.array_equal(np.stack(words).ravel(), token_stream(a_texts, 400, validation=True)[: 8 * (SEQ + 1)])
    assert np.array_equal(np.stack(digits).ravel(), token_stream(b_texts, 400, validation=True)[: 4 * (SEQ + 1)])
    assert [_from_words(w, a_vocab) for w in windows[:3]] == [True, False, True]  # interleaved, not one block each


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["sources"][0].update(weight=0), "data.sources\\[0\\].weight=0 must be a number > 0"),
        (lambda c: c["sources"][1].update(source="mixture"), "data.sources\\[1\\].source='mixture' is not one of"),
        (lambda c: c["sources"][1].update(label="words"), "labels must differ"),
        (lambda c: c["sources"][0].update(shuffle_buffer=3), "data.sources\\[0\\]: unknown key\\(s\\) \\['shuffle_buffer'\\]"),
        (lambda c: c.update(sources=[]), "needs data.sources"),
        (lambda c: c.update(paths=["x"]), "data.paths is for source=files, not source=mixture"),
    ],
)
def test_bad_mixtures_fail_clearly(sources, change, message):
    root, *_ = sources
    cfg = _cfg(root)
    change(cfg)
    with pytest.raises(DataError, match=message):
        resolve(cfg)
