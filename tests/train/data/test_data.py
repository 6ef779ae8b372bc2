"""The data pipeline against an independent computation (`data_corpus`): tokenize the documents here,
concatenate, cut. One stream (data.streams=1, as the configs below set it) unless a test says otherwise;
tests/train/data/test_data_streams.py covers several streams, workers and data-parallel ranks."""

import io
import json
import os
import re
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from data_corpus import doc, files_cfg, text_corpus
from data_corpus import take as _batches
from data_corpus import token_stream as _stream
from omegaconf import OmegaConf

from train.data import DataError, TrainBatches, check_data_config, validation_batches
from train.data import records as data_records
from train.data import sources as data_sources
from train.data.tokenizer import gpt2

SEQ = 16  # windows of 17 tokens


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 .txt files (one document each) and their texts, in file-name order."""
    return text_corpus(tmp_path_factory.mktemp("corpus"), 40)


def _cfg(root, **kw):
    return files_cfg(root, **{"shuffle_buffer": 4, "val_permille": 200, **kw})


def test_split_is_nontrivial(corpus):
    """The fixture's documents land in both splits (otherwise the split tests prove nothing)."""
    _, texts = corpus
    n_val = sum(zlib.crc32(t.encode()) % 1000 < 200 for t in texts)
    assert 3 <= n_val <= len(texts) - 3


def test_windows_concatenate_to_the_stream_across_epochs(corpus):
    """Unshuffled (shuffle_buffer=1), the windows are consecutive slices of the stream, epoch after epoch."""
    root, texts = corpus
    stream = _stream(texts, 200)
    n_windows = 2 * len(stream) // (SEQ + 1) + 3  # past the end of the first epoch
    it = TrainBatches(_cfg(root, shuffle_buffer=1), SEQ, 3, 0, 1, seed=0)
    got = torch.cat(_batches(it, n_windows // 3 + 1))  # (N, T+1)
    assert got.shape[1] == SEQ + 1 and got.dtype == torch.int64
    flat = got.flatten().numpy()
    assert np.array_equal(flat, np.concatenate([stream] * 3)[: len(flat)])
    assert it.windows_served == len(got) and it.tokens_served == len(got) * SEQ


def test_shuffle_is_a_seeded_permutation_within_each_chunk(corpus):
    root, texts = corpus
    windows = _stream(texts, 200)[: 6 * 4 * (SEQ + 1)].reshape(6 * 4, SEQ + 1)  # 6 chunks of 4
    run = lambda seed: torch.cat(_batches(TrainBatches(_cfg(root), SEQ, 6, 0, 1, seed), 4))  # (24, T+1)
    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not np.array_equal(a.numpy(), windows)  # shuffled at all
    for got in (a, c):
        orders = []
        for k in range(6):
            chunk = list(map(tuple, got[4 * k : 4 * k + 4].numpy()))
            plain = list(map(tuple, windows[4 * k : 4 * k + 4]))
            assert sorted(chunk) == sorted(plain)
            orders.append(tuple(plain.index(w) for w in chunk))
        assert len(set(orders)) > 1  # each chunk draws its own permutation


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_data_parallel_slices_make_up_the_global_batch(corpus, dp):
    root, _ = corpus
    cfg = _cfg(root, shuffle_buffer=5)  # chunks straddle global batches
    whole = _batches(TrainBatches(cfg, SEQ, 12, 0, 1, seed=3), 6)
    ranks = [TrainBatches(cfg, SEQ, 12, r, dp, seed=3) for r in range(dp)]
    for step in range(6):
        parts = [next(it) for it in ranks]
        assert all(p.shape == (12 // dp, SEQ + 1) for p in parts)
        assert torch.equal(torch.cat(parts), whole[step])


def _roundtrip(state):
    """The state as it comes back from a checkpoint: JSON and torch.save both."""
    buf = io.BytesIO()
    torch.save(json.loads(json.dumps(state)), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    "steps, epoch, chunk_boundary",  # chunks of 4 windows, 2 windows a step; an epoch is ~300 windows
    [(3, 0, False), (4, 0, True), (201, 1, False), (200, 1, True)],
)
def test_resume_gives_the_identical_next_batches(corpus, steps, epoch, chunk_boundary):
    root, _ = corpus
    cfg = _cfg(root)
    reference = _batches(TrainBatches(cfg, SEQ, 2, 0, 1, seed=5), steps + 4)
    saved_at_dp2 = [TrainBatches(cfg, SEQ, 2, r, 2, seed=5) for r in range(2)]
    for it in saved_at_dp2:
        _batches(it, steps)
    state = _roundtrip(saved_at_dp2[0].state_dict())
    assert state == saved_at_dp2[1].state_dict()  # the state does not depend on the rank
    cursor = state["lanes"]["0/0"]["cursor"]
    assert cursor["epoch"] == epoch and (state["windows_served"] % 4 == 0) == chunk_boundary
    assert cursor["offset"] > 0  # the chunk starts inside a document
    resumed = TrainBatches(cfg, SEQ, 2, 0, 1, seed=5)  # dp=1 now
    resumed.load_state_dict(state)
    assert resumed.windows_served == 2 * steps
    for want in reference[steps : steps + 2]:
        assert torch.equal(next(resumed), want)
    again = TrainBatches(cfg, SEQ, 2, 0, 1, seed=5)  # a second resume, from a state saved after a resume
    again.load_state_dict(_roundtrip(resumed.state_dict()))
    for want in reference[steps + 2 :]:
        assert torch.equal(next(again), want)


def test_resume_reads_at_most_one_chunk_again(corpus, monkeypatch):
    """Resuming restarts from datasets' saved document position, not from the first document."""
    root, texts = corpus
    cfg = _cfg(root)
    it = TrainBatches(cfg, SEQ, 2, 0, 1, seed=5)
    _batches(it, 30)
    state = it.state_dict()
    assert state["lanes"]["0/0"]["cursor"]["at"] is not None
    records = []
    counting = lambda text, permille: records.append(text) or zlib.crc32(text.encode()) % 1000 < permille
    monkeypatch.setattr(data_records, "is_validation", counting)
    resumed = TrainBatches(cfg, SEQ, 2, 0, 1, seed=5)
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed), next(it))
    tokens_read = sum(len(gpt2().encode_ordinary(t)) + 1 for t in records)
    assert tokens_read < 4 * (SEQ + 1) + 2 * max(len(gpt2().encode_ordinary(t)) for t in texts)


def test_resume_rejects_a_different_stream(corpus):
    root, _ = corpus
    it = TrainBatches(_cfg(root), SEQ, 2, 0, 1, seed=5)
    next(it)
    other = TrainBatches(_cfg(root), SEQ, 2, 0, 1, seed=6)
    with pytest.raises(DataError, match="seed"):
        other.load_state_dict(it.state_dict())


def test_global_batch_may_change_between_batches(corpus):
    """A batch-size ramp: positions count windows, so 2+4 windows equal 3+3."""
    root, _ = corpus
    a, b = TrainBatches(_cfg(root), SEQ, 2, 0, 1, seed=1), TrainBatches(_cfg(root), SEQ, 3, 0, 1, seed=1)
    assert torch.equal(torch.cat([a.next_batch(2), a.next_batch(4)]), torch.cat([next(b), next(b)]))


def test_validation_and_training_never_share_a_document(corpus):
    root, texts = corpus
    val_stream = _stream(texts, 200, validation=True)
    n_val = len(val_stream) // (SEQ + 1)
    val = validation_batches(_cfg(root), SEQ, 1, n_val, 0, 1)
    assert np.array_equal(torch.cat(val).flatten().numpy(), val_stream[: n_val * (SEQ + 1)])
    assert all(torch.equal(x, y) for x, y in zip(val, validation_batches(_cfg(root), SEQ, 1, n_val, 0, 1)))
    # By content: with 2-token windows only a final <|endoftext|> can fall off, so every marker shows.
    n_train = len(_stream(texts, 200)) // 2
    train = TrainBatches(_cfg(root, shuffle_buffer=1), 1, n_train, 0, 1, seed=0)
    val = validation_batches(_cfg(root), 1, len(val_stream) // 2, 1, 0, 1)
    markers = lambda windows: set(re.findall(r"<<doc\d+>>", gpt2().decode(windows.flatten().tolist())))
    seen_val, seen_train = markers(val[0]), markers(next(train))
    assert seen_val and seen_train and not seen_val & seen_train
    assert seen_val | seen_train == {f"<<doc{i}>>" for i in range(40)}


def test_validation_is_sliced_by_rank_and_fails_clearly_when_short(corpus):
    root, _ = corpus
    whole = validation_batches(_cfg(root), SEQ, 4, 3, 0, 1)
    halves = [validation_batches(_cfg(root), SEQ, 4, 3, r, 2) for r in range(2)]
    for k in range(3):
        assert torch.equal(torch.cat([halves[0][k], halves[1][k]]), whole[k])
    with pytest.raises(DataError, match="validation split holds .* fewer than the 40000 asked for"):
        validation_batches(_cfg(root), SEQ, 4, 10000, 0, 1)


def test_record_files_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [doc(i) for i in range(12)]
    with open(tmp_path / "a.jsonl", "w", encoding="utf-8") as f:
        for t in texts[:7]:
            f.write(json.dumps({"id": 1, "content": t}) + "\n")
    with open(tmp_path / "b.jsonl", "w", encoding="utf-8") as f:
        for t in texts[7:]:
            f.write(json.dumps({"id": 2, "content": t}) + "\n")
    pq.write_table(pa.table({"content": texts}), tmp_path / "c.parquet")
    stream = _stream(texts, 0)
    n = len(stream) // (SEQ + 1)
    for paths in ([str(tmp_path / "*.jsonl")], [str(tmp_path / "c.parquet")]):
        cfg = {"source": "files", "paths": paths, "text_field": "content", "streams": 1, "shuffle_buffer": 1,
               "val_permille": 0}
        got = torch.cat(_batches(TrainBatches(cfg, SEQ, 1, 0, 1, 0), n)).flatten().numpy()
        assert np.array_equal(got, stream[: n * (SEQ + 1)])
    with pytest.raises(DataError, match="text_field='text' is not a field .* \\['id', 'content'\\]"):
        check_data_config({"source": "files", "paths": [str(tmp_path / "a.jsonl")]})


def test_stdlib_source_is_the_standard_library_in_order():
    root = sysconfig.get_paths()["stdlib"]
    spec = data_sources.resolve({"source": "stdlib"}).sources[0]
    assert len(spec.files) > 500 and len(set(spec.files)) == len(spec.files)
    # a fixed order by crc32 of the relative path, so folders are interleaved rather than in runs
    crcs = [zlib.crc32(os.path.relpath(f, root).encode()) for f in spec.files]
    assert crcs == sorted(crcs) and spec.files != tuple(sorted(spec.files))
    assert os.path.join(root, "os.py") in spec.files
    assert not any("site-packages" in f for f in spec.files)
    texts = [Path(path).read_text(encoding="utf-8") for path in spec.files[:30]]  # all valid UTF-8
    assert "" in texts  # an empty file: skipped, not a lone <|endoftext|>
    stream = _stream([t for t in texts if t], 0)
    n = len(stream) // 257 - 1
    cfg = {"source": "stdlib", "streams": 1, "shuffle_buffer": 1, "val_permille": 0}
    got = torch.cat(_batches(TrainBatches(cfg, 256, n, 0, 1, 0), 1)).flatten().numpy()
    assert np.array_equal(got, stream[: n * 257])


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"source": "files", "paths": ["/nonexistent/corpus.txt"]}, "no such file '/nonexistent/corpus.txt'"),
        ({"source": "files", "paths": ["/nonexistent/*.jsonl"]}, "glob '/nonexistent/\\*.jsonl' matches no files"),
        ({"source": "files", "paths": []}, "needs data.paths"),
        ({"source": "web"},
         "data.source='web' is not one of \\['stdlib', 'docstrings', 'files', 'hub', 'prepared', 'mixture'\\]"),
        ({"source": "stdlib", "shufle_buffer": 3}, "unknown key\\(s\\) \\['shufle_buffer'\\]"),
        ({"source": "stdlib", "val_permille": 1000}, "val_permille=1000"),
        ({"source": "hub"}, "needs data.name"),
    ],
)
def test_bad_configs_fail_clearly(cfg, message):
    with pytest.raises(DataError, match=message):
        check_data_config(cfg)


@pytest.mark.parametrize(
    "name, error",
    [
        ("stdlib", None),
        ("docstrings", None),
        ("files", "needs data.paths"),
        ("hub", "needs data.name"),
        ("prepared", "needs data.path"),
        ("mixture", "data.sources\\[0\\].source=files needs data.sources\\[0\\].paths"),
        ("gpt3_mixture", "data.sources\\[0\\].path='/data/gpt3/common_crawl' is not a prepared dataset"),
    ],
)
def test_shipped_data_configs(name, error):
    """configs/data/*.yaml: the default works as is; the others say what they still need. Every file is
    listed here, and every shipped file sets the pipeline's keys (each is documented there)."""
    from hydra import compose, initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_config

    folder = CONFIG_DIR / "data"
    shipped = {"docstrings", "stdlib", "files", "hub", "prepared", "mixture", "gpt3_mixture"}
    assert {p.stem for p in folder.glob("*.yaml")} == shipped
    assert {"streams", "shuffle_buffer", "workers", "prefetch"} <= set(OmegaConf.load(folder / f"{name}.yaml"))
    register_config()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("config", overrides=[f"data={name}"]).data  # on its kind's schema, as a run composes it
    if error is None:
        check_data_config(cfg)
    else:
        with pytest.raises(DataError, match=error):
            check_data_config(cfg)


def test_gpt3_mixture_example_has_the_papers_shape():
    """Brown et al. 2020, Table 2.2: Common Crawl 60%, WebText2 22%, Books1 8%, Books2 8%, Wikipedia 3%
    (printed rounded, summing to 101%; resolved weights are the same ratios, normalised)."""
    cfg = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[3] / "configs" / "data" / "gpt3_mixture.yaml"))
    paper = {"common_crawl": 60, "webtext2": 22, "books1": 8, "books2": 8, "wikipedia": 3}
    assert {e["label"]: round(100 * e["weight"]) for e in cfg["sources"]} == paper
    for entry in cfg["sources"]:  # every entry resolves once its folder exists: point it at a prepared dataset
        assert entry["source"] in data_sources.KINDS
    assert cfg["shuffle_buffer"] % cfg["streams"] == 0 and 256 % cfg["streams"] == 0  # gpt3-125m: 256 sequences


def test_bad_files_fail_clearly(tmp_path):
    for name in ("a.txt", "b.jsonl", "c.csv"):
        (tmp_path / name).write_text("{}\n")
    with pytest.raises(DataError, match="mixes file kinds \\['.jsonl', '.txt'\\]"):
        check_data_config({"source": "files", "paths": [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]})
    valid = "valid: .txt, .jsonl, .json, .parquet"
    with pytest.raises(DataError, match="unsupported extension\\(s\\) \\['.csv'\\]; " + valid):
        check_data_config({"source": "files", "paths": [str(tmp_path / "*")]})
    missing = OmegaConf.create({"source": "files", "paths": "???", "text_field": "text"})
    with pytest.raises(DataError, match="needs data.paths"):
        check_data_config(missing)
    with pytest.raises(DataError, match="no such file"):  # the training iterator checks at construction
        TrainBatches({"source": "files", "paths": [str(tmp_path / "gone.txt")]}, SEQ, 2, 0, 1, 0)
    with pytest.raises(DataError, match="does not split evenly over 4"):
        TrainBatches({"source": "files", "paths": [str(tmp_path / "a.txt")]}, SEQ, 6, 0, 4, 0)


def test_hub_reachability_is_checked_only_for_names_that_need_the_network(monkeypatch, tmp_path):
    """A Hub name with no route to the Hub fails at once; in offline mode (the local datasets cache) and for a
    local folder the check is not made (nothing listens at the endpoint, so it would fail)."""
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: like no network
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    cfg = {"source": "hub", "name": "HuggingFaceFW/fineweb"}
    with pytest.raises(DataError, match="cannot reach it \\(127.0.0.1:9.*a local dataset folder.*HF_DATASETS_OFFLINE=1"):
        check_data_config(cfg)
    assert check_data_config({"source": "hub", "name": str(tmp_path)}).sources[0].name == str(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert check_data_config(cfg).sources[0].name == "HuggingFaceFW/fineweb"
