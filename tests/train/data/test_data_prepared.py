"""`python -m train.prepare_data` and `data=prepared`: tokenized once with datasets' map(num_proc) and
save_to_disk, then the same windows, order, validation and resume as streaming the source."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from cli import run_module
from data_corpus import doc, take, token_stream

from train.data import DataError, TrainBatches, validation_batches
from train.data.sources import resolve

SEQ = 16


def prepare(*args: str) -> subprocess.CompletedProcess:
    return run_module("train.prepare_data", list(args), env=dict(os.environ))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two .jsonl files (field "content", two bad records among them) and the folder prepared from them."""
    root = tmp_path_factory.mktemp("prepared")
    texts = [doc(i) for i in range(50)]
    for k in range(2):
        with open(root / f"part{k}.jsonl", "w", encoding="utf-8") as f:
            for i, text in enumerate(texts[25 * k : 25 * k + 25]):
                f.write(json.dumps({"content": text}) + "\n")
                if i == 3:
                    f.write(json.dumps({"title": "no content"}) + "\n")
    files = {"source": "files", "paths": [str(root / "*.jsonl")], "text_field": "content", "val_permille": 200}
    out = root / "out"
    proc = prepare("data=files", f"data.paths=[{root}/*.jsonl]", "data.text_field=content", "data.val_permille=200",
                   f"out={out}", "num_proc=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, out, files, texts, proc


def _cfgs(files, out, **kw):
    pipeline = {"streams": 4, "shuffle_buffer": 8, **kw}
    return {**files, **pipeline}, {"source": "prepared", "path": str(out), **pipeline}


def test_prepare_writes_a_datasets_folder_in_one_step(prepared):
    import datasets

    root, out, _, texts, proc = prepared
    splits = datasets.load_from_disk(str(out))
    assert set(splits) == {"train", "validation"} and splits["train"].column_names == ["doc", "tokens"]
    train_tokens = [t for row in splits["train"]["tokens"] for t in row]
    assert train_tokens == token_stream(texts, 200).tolist()
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no partial folder left
    assert "part0.jsonl: no_text ×1" in proc.stdout and "part1.jsonl: no_text ×1" in proc.stdout
    assert f"prepared {out}: {len(splits['train'])} training and {len(splits['validation'])} validation documents, " \
           f"{len(train_tokens):,} training tokens" in proc.stdout


@pytest.mark.parametrize("dp", [1, 2])
def test_prepared_gives_the_streamed_batches(prepared, dp):
    _, out, files, _, _ = prepared
    streamed, ready = _cfgs(files, out)
    want = take(TrainBatches(streamed, SEQ, 8, 0, 1, seed=2), 80)  # past an epoch of every stream
    ranks = [TrainBatches(ready, SEQ, 8, r, dp, seed=2) for r in range(dp)]
    for k in range(80):
        assert torch.equal(torch.cat([next(it) for it in ranks]), want[k]), k


def test_prepared_validation_and_resume_match_streaming(prepared):
    _, out, files, _, _ = prepared
    streamed, ready = _cfgs(files, out, workers=1)
    for a, b in zip(validation_batches(streamed, SEQ, 4, 3, 0, 1), validation_batches(ready, SEQ, 4, 3, 0, 1)):
        assert torch.equal(a, b)
    want = take(TrainBatches(streamed, SEQ, 8, 0, 1, seed=3), 30)
    first = TrainBatches(ready, SEQ, 8, 0, 1, seed=3)
    try:
        take(first, 11)
        state = json.loads(json.dumps(first.state_dict()))
    finally:
        first.close()
    again = TrainBatches(ready, SEQ, 8, 0, 1, seed=3)
    again.load_state_dict(state)
    try:
        assert all(torch.equal(a, b) for a, b in zip(take(again, 19), want[11:]))
    finally:
        again.close()


def test_prepared_sources_mix_like_streamed_ones(prepared):
    root, out, files, _, _ = prepared
    entry = {"label": "web", "weight": 3, **files}
    other = {"label": "code", "weight": 1, "source": "stdlib"}
    mix = lambda first: {"source": "mixture", "sources": [first, other], "streams": 2, "shuffle_buffer": 4}
    ready = {"label": "web", "weight": 3, "source": "prepared", "path": str(out)}
    a, b = take(TrainBatches(mix(entry), SEQ, 4, 0, 1, seed=0), 40), take(TrainBatches(mix(ready), SEQ, 4, 0, 1, seed=0), 40)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_prepare_refuses_what_it_cannot_do(prepared, tmp_path):
    root, out, _, _, _ = prepared
    cases = [
        ([f"data.paths=[{root}/*.jsonl]", "data=files", "data.text_field=content", f"out={out}"], f"out={out} exists"),
        (["model.n_layer=2", f"out={tmp_path / 'x'}"], "prepare_data takes data overrides"),
        (["data=stdlib"], "out=FOLDER is required"),
        (["data=mixture", f"out={tmp_path / 'y'}", f"data.sources.0.paths=[{root}/*.jsonl]"], "prepare each source"),
        (["data=files", "data.paths=[/nonexistent/*.jsonl]", f"out={tmp_path / 'z'}"], "matches no files"),
    ]
    for args, message in cases:
        proc = prepare(*args)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert not any(p.exists() for p in (tmp_path / "x", tmp_path / "y", tmp_path / "z"))
    with pytest.raises(DataError, match="is not a prepared dataset"):
        resolve({"source": "prepared", "path": str(root)})
