"""Bad input: explicit decoding, bad records skipped and counted (or an error naming file and record), and
corpora that cannot train caught before any model is built — through the API and through `python -m train`."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from cli import train as run_train
from data_corpus import take, token_stream, write_texts

from train.data import DataError, TrainBatches, check_data
from train.data.probe import Evaluation
from train.data.tokenizer import gpt2

SEQ = 16
LATIN1 = "Ærøskøbing, café, señor, naïve: accented letters in a Latin-1 file. " * 3


def _binary() -> bytes:
    """64 KB of bytes with NULs in them, as an image or a zip would be."""
    return bytes(np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8))


@pytest.fixture()
def mixed(tmp_path):
    """Good .txt files, a 64 KB binary file and a Latin-1 file."""
    good = [f"good document {i}: " + "some plain words here " * (i + 3) for i in range(12)]
    write_texts(tmp_path, good, prefix="a")
    (tmp_path / "b_binary.txt").write_bytes(_binary())
    (tmp_path / "c_latin1.txt").write_bytes(LATIN1.encode("latin-1"))
    return tmp_path, good


def _cfg(root, pattern="*.txt", **kw):
    return {"source": "files", "paths": [str(root / pattern)], "streams": 1, "piece_chars": 0, "shuffle_buffer": 1,
            "val_permille": 0, **kw}


def _windows(cfg, n) -> np.ndarray:
    return torch.cat(take(TrainBatches(cfg, SEQ, 1, 0, 1, seed=0), n)).flatten().numpy()


def test_binary_and_undecodable_files_are_skipped_counted_and_named(mixed, capsys):
    root, good = mixed
    stream = token_stream(good, 0)
    n = len(stream) // (SEQ + 1)
    it = TrainBatches(_cfg(root), SEQ, 1, 0, 1, seed=0)
    got = torch.cat(take(it, n + 2)).flatten().numpy()  # into the second epoch: every file read once
    assert np.array_equal(got[: n * (SEQ + 1)], stream[: n * (SEQ + 1)])  # only the good files' tokens
    binary, latin1 = str(root / "b_binary.txt"), str(root / "c_latin1.txt")
    assert it.bad_records() == {binary: {"binary": 1}, latin1: {"undecodable": 1}}
    err = capsys.readouterr().err
    assert f"{binary}: the file: binary data (NUL bytes); skipped" in err
    assert f"{latin1}: the file: not valid utf-8 at byte 0" in err and "data.encoding" in err
    assert err.count("warning") == 2  # once per file, not per epoch


def test_the_encoding_is_explicit(mixed):
    root, good = mixed
    it = TrainBatches(_cfg(root, "c_latin1.txt", encoding="latin-1"), SEQ, 1, 0, 1, seed=0)
    want = np.array(gpt2().encode_ordinary(LATIN1) + [50256])
    got = torch.cat(take(it, len(want) // (SEQ + 1))).flatten().numpy()
    assert np.array_equal(got, want[: len(got)])
    assert "\ufffd" not in gpt2().decode(got.tolist()) and it.bad_records() == {}
    with pytest.raises(DataError, match="data.encoding='klingon' is not an encoding Python knows"):
        TrainBatches(_cfg(root, encoding="klingon"), SEQ, 1, 0, 1, seed=0)


def _jsonl(path, records):
    with open(path, "wb") as f:
        for r in records:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())


def test_jsonl_records_without_text_are_skipped_and_counted(tmp_path, capsys):
    texts = [f"record {i} " + "words " * (i + 5) for i in range(20)]
    records = [{"text": t} for t in texts[:10]]
    records += [{"title": "no text here"}, {"text": None}, b"{not json\n", b"\n", {"text": 7}, b'"a string"\n']
    records += [{"text": t} for t in texts[10:]]
    records += [b'{"text": "caf\xe9"}\n']  # Latin-1 bytes inside a UTF-8 .jsonl
    _jsonl(tmp_path / "c.jsonl", records)
    stream = token_stream(texts, 0)
    n = len(stream) // (SEQ + 1)
    it = TrainBatches(_cfg(tmp_path, "c.jsonl"), SEQ, 1, 0, 1, seed=0)
    got = torch.cat(take(it, n + 2)).flatten().numpy()
    assert np.array_equal(got[: n * (SEQ + 1)], stream[: n * (SEQ + 1)])
    file = str(tmp_path / "c.jsonl")
    assert it.bad_records() == {file: {"no_text": 3, "not_json": 2, "undecodable": 1}}
    err = capsys.readouterr().err
    assert f"{file}: line 11: the text field 'text' is missing; skipped" in err
    assert f"{file}: line 13: not JSON" in err and f"{file}: line 27: not valid utf-8" in err


def test_on_bad_record_error_stops_with_the_file_and_record(tmp_path):
    _jsonl(tmp_path / "c.jsonl", [{"text": "fine " * 50}, {"text": "also fine " * 40}, {"title": "x"}])
    it = TrainBatches(_cfg(tmp_path, "c.jsonl", on_bad_record="error"), SEQ, 1, 0, 1, seed=0)
    with pytest.raises(DataError, match=f"{tmp_path / 'c.jsonl'}: line 3: the text field 'text' is missing; stopped"):
        take(it, 100)
    with pytest.raises(DataError, match="data.on_bad_record='warn' is not one of \\['skip', 'error'\\]"):
        TrainBatches(_cfg(tmp_path, "c.jsonl", on_bad_record="warn"), SEQ, 1, 0, 1, seed=0)


def test_a_workers_error_reaches_the_training_thread(mixed):
    root, _ = mixed
    it = TrainBatches(_cfg(root, on_bad_record="error", workers=1), SEQ, 1, 0, 1, seed=0)
    try:
        with pytest.raises(DataError, match="b_binary.txt: the file: binary data"):
            take(it, 200)
    finally:
        it.close()


def test_parquet_and_json_array_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i} " + "tokens " * (i + 4) for i in range(9)]
    pq.write_table(pa.table({"text": texts[:4] + [None] + texts[4:]}), tmp_path / "a.parquet", row_group_size=3)
    (tmp_path / "b.json").write_text(json.dumps([{"text": t} for t in texts[:5]] + [{"body": "x"}] + [{"text": t} for t in texts[5:]]))
    stream = token_stream(texts, 0)
    n = len(stream) // (SEQ + 1)
    for name, where in (("a.parquet", "row 5"), ("b.json", "record 6")):
        it = TrainBatches(_cfg(tmp_path, name), SEQ, 1, 0, 1, seed=0)
        assert np.array_equal(torch.cat(take(it, n)).flatten().numpy(), stream[: n * (SEQ + 1)])
        assert it.bad_records() == {str(tmp_path / name): {"no_text": 1}}
        with pytest.raises(DataError, match=f"{name}: {where}: the text field 'text' is missing"):
            take(TrainBatches(_cfg(tmp_path, name, on_bad_record="error"), SEQ, 1, 0, 1, seed=0), n)


def test_resume_inside_record_files_reads_from_the_saved_record(tmp_path):
    """Cursors of .jsonl (byte offset) and parquet (row group) files, across files and row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"doc {i} " + "alpha beta " * (i % 6 + 1) for i in range(40)]
    for k in range(2):
        _jsonl(tmp_path / f"{k}.jsonl", [{"text": t} for t in texts[20 * k : 20 * k + 20]])
        pq.write_table(pa.table({"text": texts[20 * k : 20 * k + 20]}), tmp_path / f"{k}.parquet", row_group_size=7)
    for pattern in ("*.jsonl", "*.parquet"):
        cfg = {**_cfg(tmp_path, pattern), "streams": 2, "shuffle_buffer": 4}
        reference = take(TrainBatches(cfg, SEQ, 2, 0, 1, seed=1), 60)
        for stop in (7, 31):
            first = TrainBatches(cfg, SEQ, 2, 0, 1, seed=1)
            take(first, stop)
            again = TrainBatches(cfg, SEQ, 2, 0, 1, seed=1)
            again.load_state_dict(json.loads(json.dumps(first.state_dict())))
            assert all(torch.equal(a, b) for a, b in zip(take(again, 60 - stop), reference[stop:])), (pattern, stop)


@pytest.mark.parametrize(
    "setup, kw, message",
    [
        ("empty", {}, "the corpus holds no text to train on: 3 record\\(s\\) read, 3 empty"),
        ("binary", {}, "holds no text to train on: 2 record\\(s\\) read, 0 empty, 2 skipped as bad \\(.*z0.txt: binary ×1"),
        ("good", {"val_permille": 999}, "the training split is empty: all 6 document\\(s\\) are held out"),
        ("good", {"streams": 8, "shuffle_buffer": 8}, "with data.streams=8, stream\\(s\\) \\[6, 7\\] get no training document"),
        ("good", {"evaluation": Evaluation(SEQ + 1, 4, 1)},
         "at most 10% of the corpus's .* tokens, too few for one validation batch of 4 windows of 17 tokens; set "
         "train.eval_interval=0 \\(no validation\\), or lower train.global_batch_size or model.seq_len"),
        ("binary", {"on_bad_record": "error"}, "z0.txt: the file: binary data \\(NUL bytes\\); stopped"),
    ],
)
def test_corpora_that_cannot_train_are_refused_by_the_probe(tmp_path, setup, kw, message):
    if setup == "empty":
        write_texts(tmp_path, ["", "", ""])
    elif setup == "binary":
        for name in ("z0.txt", "z1.txt"):
            (tmp_path / name).write_bytes(_binary())
    else:
        write_texts(tmp_path, [f"document {i} " * 9 for i in range(6)])
    evaluation = kw.pop("evaluation", None)
    with pytest.raises(DataError, match=message):
        check_data(_cfg(tmp_path, **kw), evaluation=evaluation)


def test_the_probe_reads_only_what_it_needs(tmp_path, monkeypatch):
    write_texts(tmp_path, [f"document {i} " * 9 for i in range(50)])
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    check_data(_cfg(tmp_path, streams=4, shuffle_buffer=4))
    assert len([p for p in opened if str(p).endswith(".txt")]) == 4  # one training document per stream


# -- through the command line -----------------------------------------------------------------------------

CLI = ["train.max_steps=2", "train.eval_interval=0", "train.checkpoint_interval=0", "logging.wandb.mode=disabled",
       "model.n_layer=1"]


def test_cli_trains_past_binary_latin1_and_fieldless_records_with_warnings(tmp_path, mixed):
    """One run over a mixture of two `files` sources: .txt files with a 64 KB binary and a Latin-1 file, and a
    .jsonl whose later records lack the text field. Each bad file is named once (four streams read it)."""
    root, _ = mixed
    _jsonl(tmp_path / "c.jsonl", [{"text": "words " * (40 + i)} for i in range(12)] + [{"meta": i} for i in range(4)])
    sources = (f"[{{label: txt, weight: 1, source: files, paths: ['{root}/*.txt']}},"
               f" {{label: jsonl, weight: 1, source: files, paths: ['{tmp_path}/c.jsonl'], val_permille: 0}}]")
    proc = run_train(tmp_path / "run", None, *CLI, "data=mixture", f"data.sources={sources}", "train.max_steps=8")
    assert "b_binary.txt: the file: binary data (NUL bytes); skipped" in proc.stderr
    assert "c_latin1.txt: the file: not valid utf-8" in proc.stderr
    assert "c.jsonl: line 13: the text field 'text' is missing; skipped" in proc.stderr
    assert proc.stderr.count("gpt3d: warning") == 3
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize(
    "files, overrides, message",
    [
        ({"empty.txt": b""}, [], "the corpus holds no text to train on: 1 record(s) read, 1 empty"),
        ({"a.txt": _binary(), "b.txt": b"\x00" * 10}, [], "2 skipped as bad"),
        ({"a.txt": b"hello " * 50}, ["data.val_permille=999"], "the training split is empty"),
        ({"a.txt": _binary(), "b.txt": b"fine " * 50}, ["data.on_bad_record=error"], "a.txt: the file: binary data"),
    ],
    ids=["empty-file", "all-binary", "all-validation", "bad-record-error"],
)
def test_cli_refuses_a_corpus_that_cannot_train_before_building_anything(tmp_path, files, overrides, message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, content in files.items():
        (corpus / name).write_bytes(content)
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, corpus, *CLI, "train.global_batch_size=2", "data.streams=1", "data.shuffle_buffer=1",
                     *overrides, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "gpt3d: error: data:" in proc.stderr
    assert "Traceback" not in proc.stderr and "model toy" not in proc.stdout
    assert not os.path.exists(run_dir)


def test_hub_reader_deals_records_to_streams_and_resumes_from_datasets_state(tmp_path):
    """The Hub reader on a local folder (datasets.load_dataset takes a path as it takes a Hub name)."""
    from train.data.records import records
    from train.data.sources import SourceSpec

    texts = [f"hub record {i}" for i in range(23)]
    _jsonl(tmp_path / "part.jsonl", [{"text": t} if i != 5 else {"x": 1} for i, t in enumerate(texts)])
    src = SourceSpec("hub", "hub", "hub", name=str(tmp_path))
    per_stream = [list(records(src, s, 3)) for s in range(3)]
    for s, got in enumerate(per_stream):
        assert [r.index for r in got] == list(range(s, 23, 3))
        assert [r.text for r in got if r.index != 5] == [texts[i] for i in range(s, 23, 3) if i != 5]
    assert [r.text.reason for r in per_stream[2] if r.index == 5] == ["no_text"]
    resumed = list(records(src, 1, 3, per_stream[1][4].pos))
    assert [r.text for r in resumed] == [r.text for r in per_stream[1][4:]]
