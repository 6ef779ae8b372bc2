"""Long documents cut into pieces (train/data/pieces.py): where the cuts fall, which stream and split each
piece goes to, and that a one-file corpus gives the same global batches at every dp and resumes exactly.

References are built here from the rule itself (hand-made paragraphs, the stream formula (f + k) mod S,
the one-process batches), never from the reader's own output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_corpus import files_cfg, take
from train.data import DataError, TrainBatches, check_data, validation_batches
from train.data.pieces import cut, held_out
from train.data.probe import Evaluation
from train.data.records import in_validation, records
from train.data.sources import resolve
from train.data.tokenizer import EOT, gpt2

PARAGRAPH = 100  # characters of each hand-made paragraph, its blank line included
SMALL_ASK = Evaluation(window=2, batch=8, batches=1)  # 8 windows of 2 tokens: a held-out piece holds them


def paragraph(i: int) -> str:
    head = f"paragraph {i:04d}:"
    return head + " words" * ((PARAGRAPH - len(head) - 2) // 6) + "." * ((PARAGRAPH - len(head) - 2) % 6) + "\n\n"


def test_cut_prefers_blank_lines_then_line_ends_then_the_limit():
    book = "".join(paragraph(i) for i in range(10))
    assert len(book) == 10 * PARAGRAPH
    assert cut(book, 250) == [paragraph(2 * k) + paragraph(2 * k + 1) for k in range(5)]  # 2 whole paragraphs fit
    lines = "".join(f"line {i:02d}\n" for i in range(10))  # 8 characters a line, no blank line
    assert cut(lines, 20) == [lines[k : k + 16] for k in range(0, 80, 16)]
    assert cut("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]
    assert cut(book, 0) == [book] and cut(book, len(book)) == [book]


def test_held_out_pieces_are_the_tail_and_at_least_one():
    assert [held_out(n, 5) for n in (1, 2, 50, 300, 500)] == [0, 1, 1, 2, 2]
    assert held_out(10, 0) == 0 and held_out(10, 250) == 2  # round(2.5) is 2 in Python


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    root = tmp_path_factory.mktemp("book")
    (root / "a.txt").write_text("".join(paragraph(i) for i in range(40)))  # cut into 20 pieces of 2 paragraphs
    (root / "b.txt").write_text("short second file\n")  # file 1: one piece
    return root


def test_piece_k_of_file_f_goes_to_stream_f_plus_k_and_the_tail_to_validation(book):
    src = resolve(files_cfg(book, piece_chars=250, val_permille=100)).sources[0]
    for stream in range(3):
        got = [(r.index, r.text, in_validation(r, 100)) for r in records(src, stream, 3)]
        expected = [(k, paragraph(2 * k) + paragraph(2 * k + 1), k >= 18) for k in range(20) if k % 3 == stream]
        expected += [(1, "short second file\n", None)] if stream == 1 else []
        assert [g[:2] for g in got] == [e[:2] for e in expected]
        assert [g[2] for g in got[: len(expected) - (stream == 1)]] == [e[2] for e in expected if e[2] is not None]


def test_resume_position_inside_a_cut_file(book):
    src = resolve(files_cfg(book, piece_chars=250)).sources[0]
    whole = list(records(src, 1, 2))
    again = list(records(src, 1, 2, whole[3].pos))
    assert [r.text for r in again] == [r.text for r in whole[3:]]


def test_one_file_without_pieces_is_one_clear_error_and_with_pieces_trains(book):
    cfg = files_cfg(book, paths=None) | {"paths": [str(book / "a.txt")], "streams": 4, "shuffle_buffer": 8}
    with pytest.raises(DataError, match=r"stream\(s\) \[1, 2, 3\] get no training document"):
        check_data(cfg | {"piece_chars": 0}, 1, 8, evaluation=SMALL_ASK)
    assert check_data(cfg | {"piece_chars": 250}, 2, 8, evaluation=SMALL_ASK).streams == 4


def test_too_few_pieces_lower_default_streams_with_a_warning_but_not_set_ones(book, capsys):
    cfg = {"source": "files", "paths": [str(book / "a.txt")], "streams": 4, "shuffle_buffer": 8,
           "piece_chars": 1000, "val_permille": 5}  # 4 pieces, the last held out: 3 training pieces
    with pytest.raises(DataError, match=r"stream\(s\) \[3\] get no training document"):
        check_data(cfg, 1, 8, evaluation=SMALL_ASK)
    assert check_data(cfg, 1, 8, evaluation=SMALL_ASK, streams_set=False).streams == 2  # 3 does not divide 8
    assert capsys.readouterr().err.count("using data.streams=2") == 1


@pytest.mark.parametrize("dp", [2, 4])
def test_a_single_file_gives_the_same_global_batches_at_every_dp_and_resumes_exactly(book, dp):
    cfg = {"source": "files", "paths": [str(book / "a.txt")], "streams": 4, "shuffle_buffer": 8, "piece_chars": 250}
    one = take(TrainBatches(cfg, 16, 8, 0, 1, seed=5), 12)
    ranks = [TrainBatches(cfg, 16, 8, r, dp, seed=5) for r in range(dp)]
    for k in range(12):
        assert torch.equal(torch.cat([next(r) for r in ranks]), one[k]), f"batch {k}"
    first = TrainBatches(cfg, 16, 8, 0, 1, seed=5)
    take(first, 5)
    again = TrainBatches(cfg, 16, 8, 0, 1, seed=5)
    again.load_state_dict(first.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(take(again, 7), one[5:]))


def test_validation_windows_come_from_the_held_out_tail(book):
    cfg = {"source": "files", "paths": [str(book / "a.txt")], "streams": 1, "piece_chars": 250, "val_permille": 5}
    (batch,) = validation_batches(cfg, 16, 2, 1, 0, 1)
    tail = np.array(gpt2().encode_ordinary(paragraph(38) + paragraph(39)) + [EOT])
    assert torch.equal(batch.flatten(), torch.from_numpy(tail[: 2 * 17]).long())
