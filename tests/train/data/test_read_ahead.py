"""Reading the next batch ahead (`TrainBatches.ready`) takes nothing: the batches and the resume state are
those of a run that never reads ahead, and a data file that is gone fails the read ahead, not the batch
after it, with the position where it was. Also with background workers, which send the same error."""

import shutil

import pytest
import torch

from train.data import DataUnavailable, TrainBatches

from data_corpus import files_cfg, text_corpus

SEQ, BATCH = 16, 4


@pytest.fixture
def corpus(tmp_path):
    """30 .txt files, one document each (a test deletes them)."""
    root = tmp_path / "corpus"
    root.mkdir()
    return text_corpus(root, 30)[0]


def batches(root, **keys) -> TrainBatches:
    """Batches of `root` read 2 streams wide, a window per stream shuffled at a time, no retry."""
    cfg = files_cfg(root, streams=2, shuffle_buffer=2, val_permille=0, read_retries=0, **keys)
    return TrainBatches(cfg, SEQ, BATCH, 0, 1, seed=1)


def test_ready_changes_neither_the_batches_nor_the_state(corpus):
    ahead, plain = batches(corpus), batches(corpus)
    for _ in range(12):
        before = ahead.state_dict()
        ahead.ready(BATCH)
        assert ahead.state_dict() == before
        assert torch.equal(ahead.next_batch(BATCH), plain.next_batch(BATCH))
    assert ahead.state_dict() == plain.state_dict()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_file_gone_fails_the_read_ahead_at_the_position_before_it(corpus, workers):
    it = batches(corpus, workers=workers)
    it.next_batch(BATCH)
    shutil.rmtree(corpus)  # every file after the ones open so far
    for _ in range(30):
        before = it.state_dict()
        try:
            it.ready(BATCH)
        except DataUnavailable as err:
            assert err.path.startswith(str(corpus)) and "No such file or directory" in str(err)
            assert it.state_dict() == before
            break
        it.next_batch(BATCH)
    else:
        raise AssertionError("no read ahead met the missing files")
    it.close()
