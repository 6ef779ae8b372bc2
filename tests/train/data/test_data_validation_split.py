"""The validation split sized to what evaluation asks (train/data/probe.py): a small corpus (one text file,
a short .jsonl) holds out the tail of its text, at most 10% of it, cut by tokens; the batches are the same
at every dp.

The references are computed here from the rule: each document's GPT-2 tokens and <|endoftext|> in reading
order (a .txt file cut into pieces by pieces.cut, a .jsonl line by line), the tail their last windows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data_corpus import prose, take, write_small_corpora
from train.data import DataError, TrainBatches, check_data, validation_batches
from train.data.pieces import cut
from train.data.probe import Evaluation
from train.data.tokenizer import EOT, gpt2

# configs/data/files.yaml's values, and what evaluation asks by default: train.eval_batches=4 global batches
# of train.global_batch_size=8 windows of model.seq_len + 1 = 129 tokens
FILES = {"source": "files", "piece_chars": 16384, "val_permille": 5, "streams": 4, "shuffle_buffer": 1024}
ASK = Evaluation(window=129, batch=8, batches=4)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return write_small_corpora(tmp_path_factory.mktemp("small"))


def documents(path) -> list[list[int]]:
    """Each document's tokens and <|endoftext|>, in reading order."""
    if path.suffix == ".txt":
        texts = cut(path.read_text(encoding="utf-8"), FILES["piece_chars"])
    else:
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    return [gpt2().encode_ordinary(text) + [EOT] for text in texts]


# size class → the validation batches its tail holds (the documents held out by hash, or the last piece of a
# cut file, hold fewer than the 32 windows asked in each)
EXPECTED = {"100k": 2, "300k": 4, "1m": 4, "jsonl14": 2}


@pytest.mark.parametrize("size", list(EXPECTED))
def test_a_small_corpus_holds_out_what_evaluation_asks_within_a_tenth_the_same_at_every_dp(corpora, size, capsys):
    path = corpora[size]
    spec = check_data({**FILES, "paths": [str(path)]}, 2, 8, ASK)
    batches = EXPECTED[size]
    assert spec.val_batches == batches and spec.sources[0].val_tail is not None
    note = capsys.readouterr().out
    assert ("2 of the 4 validation batches train.eval_batches asks for" in note) == (batches < 4)
    val = validation_batches(spec, 128, 8, batches, 0, 1)
    stream = np.concatenate([np.array(d) for d in documents(path)])
    held, tenth = batches * 8 * 129, len(stream) // 10
    assert held <= tenth and (batches == 4 or tenth < (batches + 1) * 8 * 129)  # as many whole batches as fit
    assert np.array_equal(torch.cat(val).flatten().numpy(), stream[-held:])  # the last windows of the text
    halves = [validation_batches(spec, 128, 8, batches, r, 2) for r in range(2)]
    assert all(torch.equal(torch.cat([halves[0][k], halves[1][k]]), val[k]) for k in range(batches))
    one = take(TrainBatches(spec, 128, 8, 0, 1, seed=3), 6)
    ranks = [TrainBatches(spec, 128, 8, r, 2, seed=3) for r in range(2)]
    for k in range(6):
        assert torch.equal(torch.cat([next(r) for r in ranks]), one[k]), f"batch {k}"


def test_training_reads_the_text_before_the_tail_and_closes_its_cut_document(corpora):
    """One stream, no shuffling: the training windows are the token stream up to the tail, the document it
    cuts closed by <|endoftext|>, then the same again (the next epoch)."""
    path = corpora["100k"]
    spec = check_data({**FILES, "paths": [str(path)], "streams": 1, "shuffle_buffer": 1}, 1, 8, ASK)
    stream = np.concatenate([np.array(d) for d in documents(path)])
    training = np.concatenate([stream[: len(stream) - 2 * 8 * 129], [EOT]])
    epochs = np.concatenate([training, training])
    windows = take(TrainBatches(spec, 128, 1, 0, 1, seed=0), len(epochs) // 129)
    assert np.array_equal(torch.cat(windows).flatten().numpy(), epochs[: len(windows) * 129])


def test_a_corpus_too_small_for_one_validation_batch_names_the_settings_that_fix_it(tmp_path):
    path = tmp_path / "note.txt"
    path.write_text(prose(20_000))  # about 5,000 tokens: a tenth holds 3 windows of 129 tokens, not 8
    with pytest.raises(DataError, match=r"validation may take at most 10% of the corpus's [\d,]+ tokens, too few for "
                                        r"one validation batch of 8 windows of 129 tokens; set train.eval_interval=0"):
        check_data({**FILES, "paths": [str(path)]}, 1, 8, ASK, streams_set=False)  # (2 pieces: 2 streams)
    spec = check_data({**FILES, "paths": [str(path)]}, 1, 8, None, streams_set=False)  # no validation: it trains
    assert spec.val_batches == 0 and spec.sources[0].val_tail is None
