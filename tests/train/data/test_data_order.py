"""What changed between two data orders, in the settings' words (train/data/order.py)."""

from __future__ import annotations

from train.data.order import changes, stream_id
from train.data.sources import resolve


def test_each_change_is_named_by_its_setting_and_what_follows_from_other_files_is_not(tmp_path):
    for name in ("a.txt", "b.txt", "c.jsonl"):
        (tmp_path / name).write_text('{"text": "x"}\n')
    files = {"source": "files", "paths": [str(tmp_path / "a.txt")], "piece_chars": 100, "streams": 4}
    then = stream_id(resolve(files), 128, 1)
    assert changes(then, then) == []
    assert changes(then, stream_id(resolve({**files, "encoding": "latin-1", "streams": 2, "shuffle_buffer": 512}), 64, 7)) == [
        "model.seq_len 128 → 64", "train.seed 1 → 7", "data.streams 4 → 2", "data.shuffle_buffer 1024 → 512",
        "data.encoding utf-8 → iso8859-1"]  # (its codec's own name)
    assert changes(then, stream_id(resolve({**files, "paths": [str(tmp_path / "b.txt")]}), 128, 1)) == [
        "data.paths: other file names"]
    assert changes(then, stream_id(resolve({**files, "paths": [str(tmp_path / "*.txt")]}), 128, 1)) == [
        "data.paths: 1 → 2 file(s)"]
    assert changes(then, stream_id(resolve({**files, "paths": [str(tmp_path / "c.jsonl")]}), 128, 1)) == [
        "data.paths: text → json files"]  # (not the cut of text files, which only they have)
    stdlib = {"source": "stdlib", "streams": 4, "shuffle_buffer": 1024}  # (data=stdlib's own default is 256)
    assert changes(then, stream_id(resolve(stdlib), 128, 1)) == ["data.source files → stdlib"]
