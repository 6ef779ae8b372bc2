"""data.source=hub on a local dataset folder of parquet files, as `datasets` streams a Hub dataset.

With at least data.streams files, stream j is files j, j+S, j+2S, …: checked against the texts this test
wrote into each file. Through `python -m train` (gloo ranks as torchrun starts them): tp=2 × dp=2 follows
the one-process loss curve, a dp=4 checkpoint resumes at dp=2 on the same batches, a run killed with SIGKILL
resumes bit for bit, and every rank opens exactly the files of its own streams (each process's file opens
are recorded by an audit hook that a `sitecustomize` module installs). With fewer files than streams the
records are dealt as for other sources, and the run says so. With offline mode on, a dataset in the local
`datasets` cache trains and a name that is not there fails before any model is built.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli import assert_same_losses, clean_env, kill_after_first_checkpoint, metrics, start_train, train
from data_corpus import hub_cfg, parquet_dataset, short_doc, take, token_stream

from train.data import DataError, TrainBatches, check_data
from train.data.records import records
from train.data.sources import resolve

SEQ = 16
S = 4
N_FILES = 16
STEPS = ["train.max_steps=6", "train.eval_interval=0", "train.checkpoint_interval=0", "logging.wandb.mode=disabled"]
OPEN_HOOK = '''"""Test instrumentation: append every .parquet file this process opens under GPT3D_OPENS_ROOT to a log.

The variables are read at each open, not when Python starts: a warm interpreter (tests/helpers/warm.py) that
started with this hook forks runs with other environments, each logging its own opens."""
import os
import sys


def _record(event, args):
    root, log = os.environ.get("GPT3D_OPENS_ROOT"), os.environ.get("GPT3D_OPENS_LOG")
    if (root and log and event == "open" and isinstance(args[0], str) and args[0].startswith(root)
            and args[0].endswith(".parquet")):
        with open(f"{log}/rank{os.environ.get('RANK', '0')}.{os.getpid()}", "a") as out:
            out.write(os.path.basename(args[0]) + "\\n")


sys.addaudithook(_record)
'''


def _stream_texts(files: list[list[str]], s: int, streams: int) -> list[str]:
    """Stream s by file: the texts of files s, s + streams, …, in order."""
    return [t for texts in files[s::streams] for t in texts]


# -- in one process ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub16")
    return root, parquet_dataset(root, N_FILES, 3)


def test_stream_j_reads_files_j_j_plus_s_and_resumes_inside_them(dataset):
    root, files = dataset
    src = resolve(hub_cfg(root, streams=S)).sources[0]
    for s in range(S):
        got = list(records(src, s, S))
        assert [r.text for r in got] == _stream_texts(files, s, S)
        assert [r.index for r in got] == list(range(len(got)))  # numbered within the stream
        resumed = list(records(src, s, S, got[5].pos))  # inside file s + S, past a row group
        assert [r.text for r in resumed] == [r.text for r in got[5:]]


def test_batches_are_each_streams_files_tokens_stream_major(dataset):
    """Unshuffled (one window per chunk): batch k holds the next m windows of stream 0, then of stream 1, …,
    where stream s is the training documents of files s, s+S, …, epoch after epoch."""
    root, files = dataset
    per_stream = [token_stream(_stream_texts(files, s, S), 200) for s in range(S)]
    m, steps = 2, 30
    assert min(len(t) for t in per_stream) < steps * m * (SEQ + 1)  # past the end of an epoch
    it = TrainBatches(hub_cfg(root, streams=S, shuffle_buffer=S, val_permille=200), SEQ, S * m, 0, 1, seed=0)
    for k, batch in enumerate(take(it, steps)):
        for s in range(S):
            reps = np.concatenate([per_stream[s]] * (steps * m * (SEQ + 1) // len(per_stream[s]) + 2))
            want = reps[k * m * (SEQ + 1) : (k + 1) * m * (SEQ + 1)].reshape(m, SEQ + 1)
            assert np.array_equal(batch[s * m : (s + 1) * m].numpy(), want), (k, s)


def test_fewer_files_than_streams_deals_records_and_says_so(tmp_path, capsys):
    files = parquet_dataset(tmp_path, 3, 5)
    texts = [t for f in files for t in f]
    src = resolve(hub_cfg(tmp_path, streams=S)).sources[0]
    for s in range(S):
        got = list(records(src, s, S))
        assert [r.index for r in got] == list(range(s, len(texts), S))
        assert [r.text for r in got] == texts[s::S]
    check_data(hub_cfg(tmp_path, streams=S, val_permille=0))
    note = capsys.readouterr().err
    assert f"has 3 data file(s), fewer than data.streams={S}" in note
    assert "every stream reads the whole dataset" in note and "data.streams <= 3 would split it by file" in note
    check_data(hub_cfg(tmp_path, streams=3, shuffle_buffer=3, val_permille=0))
    assert capsys.readouterr().err == ""  # three files, three streams: split by file, nothing to say


def test_a_resume_state_from_a_dataset_with_other_files_is_refused(dataset, tmp_path):
    root, _ = dataset
    it = TrainBatches(hub_cfg(root, streams=S, shuffle_buffer=S), SEQ, S, 0, 1, seed=0)
    take(it, 2)
    state = it.state_dict()
    it.close()
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    parquet_dataset(fewer, N_FILES - 1, 3)
    os.rename(fewer, tmp_path / root.name)  # the same folder name, one file less
    again = TrainBatches(hub_cfg(tmp_path / root.name, streams=S, shuffle_buffer=S), SEQ, S, 0, 1, seed=0)
    again.load_state_dict(state)
    saved_with = f"now has {N_FILES - 1} data file\\(s\\); the resume state was saved when it had {N_FILES}"
    with pytest.raises(DataError, match=saved_with):
        next(again)


# -- through python -m train ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_dataset(tmp_path_factory):
    """16 files of two short documents each: in six steps (one window of 33 tokens per stream and step) every
    stream reads all of its files."""
    root = tmp_path_factory.mktemp("cli_hub16")
    files = parquet_dataset(root, N_FILES, 2, text=short_doc)
    assert max(len(token_stream(_stream_texts(files, s, S), 250)) for s in range(S)) < 6 * 33
    return root


def _hub(root: Path) -> list[str]:
    return ["data=hub", f"data.name={root}", f"data.streams={S}", "data.shuffle_buffer=8", "data.val_permille=250"]


def _env(tmp: Path, root: Path) -> dict:
    """Offline (nothing may download), a datasets cache of the test's own, and the file-open log. The hook is
    one folder beside the dataset's for every run (the same PYTHONPATH: one warm interpreter serves them all)."""
    hook, log = root.with_name(f"{root.name}-open-hook"), tmp / "opens"
    hook.mkdir(exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    if not (hook / "sitecustomize.py").exists():
        (hook / "sitecustomize.py").write_text(OPEN_HOOK)
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / "hf-cache"),
            "GPT3D_OPENS_ROOT": str(root), "GPT3D_OPENS_LOG": str(log),
            "PYTHONPATH": os.pathsep.join(p for p in [str(hook), os.environ.get("PYTHONPATH")] if p)}


def _opened_by_rank(tmp: Path) -> dict[int, set[int]]:
    """The file numbers each rank opened (its processes' logs together)."""
    out: dict[int, set[int]] = {}
    for log in (tmp / "opens").iterdir():
        rank = int(log.name.split(".")[0].removeprefix("rank"))
        out.setdefault(rank, set()).update(int(n[len("train-"):-len(".parquet")]) for n in log.read_text().split())
    return out


def _own_files(rank: int, dp: int) -> set[int]:
    per = S // dp
    return {f for f in range(N_FILES) if rank * per <= f % S < (rank + 1) * per}


@pytest.fixture(scope="module")
def hub_one_process(tmp_path_factory, cli_dataset):
    tmp = tmp_path_factory.mktemp("hub_one")
    train(tmp / "run", None, *STEPS, *_hub(cli_dataset), env=_env(tmp, cli_dataset))
    assert _opened_by_rank(tmp) == {0: set(range(N_FILES))}  # one rank, all four streams: every file
    return metrics(tmp / "run")


def test_hub_run_at_tp2_dp2_matches_one_process_and_each_rank_opens_its_own_files(tmp_path, cli_dataset,
                                                                                   hub_one_process):
    """(dp=4 alone, and dp=2 resumed: the next test.)"""
    train(tmp_path / "run", None, *STEPS, *_hub(cli_dataset), "parallel.tp=2", kind="ranks", nproc=4,
          env=_env(tmp_path, cli_dataset))
    assert_same_losses(metrics(tmp_path / "run"), hub_one_process)
    assert _opened_by_rank(tmp_path) == {r: _own_files(r // 2, 2) for r in range(4)}  # tp ranks share a dp rank


def test_hub_dp4_checkpoint_resumes_at_dp2_with_the_same_batches(tmp_path, cli_dataset, hub_one_process):
    dp4, dp2 = tmp_path / "dp4", tmp_path / "dp2"
    train(dp4 / "run", None, *STEPS, *_hub(cli_dataset), "train.checkpoint_interval=3", kind="ranks", nproc=4,
          env=_env(dp4, cli_dataset))
    assert_same_losses(metrics(dp4 / "run"), hub_one_process)
    assert _opened_by_rank(dp4) == {r: _own_files(r, 4) for r in range(4)}  # one stream, four files each
    proc = train(dp2 / "run", None, *STEPS, *_hub(cli_dataset), f"train.resume={dp4}/run/checkpoints/step00000003",
                 kind="ranks", nproc=2, env=_env(dp2, cli_dataset))
    assert "resumed from" in proc.stdout and "dp=2" in proc.stdout
    rows = metrics(dp2 / "run")
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert_same_losses(rows, hub_one_process[3:])


def test_hub_run_killed_with_sigkill_resumes_bit_for_bit(tmp_path, cli_dataset, hub_one_process, monkeypatch):
    killed, common = tmp_path / "killed", [*STEPS[1:], *_hub(cli_dataset)]
    for key, value in _env(tmp_path, cli_dataset).items():  # start_train passes on this process's environment
        monkeypatch.setenv(key, value)
    proc = start_train(killed, None, *common, "train.max_steps=100000", "train.checkpoint_interval=2", log=tmp_path / "log")
    try:
        resumed_from = kill_after_first_checkpoint(proc, killed, tmp_path / "log")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert 2 <= resumed_from < 6
    out = train(killed, None, *common, "train.max_steps=6")
    assert f"resumed from {killed / 'checkpoints' / f'step{resumed_from:08d}'} at step {resumed_from}" in out.stdout
    keys = ["step", "tokens", "train/loss", "train/grad_norm", "train/lr"]
    assert [[r[k] for k in keys] for r in metrics(killed)] == [[r[k] for k in keys] for r in hub_one_process]


def test_offline_a_dataset_in_the_cache_trains_and_one_not_there_fails_before_the_model(tmp_path):
    """A dataset loaded once (without streaming) sits in the datasets cache; offline, data.name finds it there.
    The cache holds it as one Arrow file, fewer than the two streams: the run says so and deals records."""
    cache, copy = tmp_path / "hf-cache", tmp_path / "toycorpus"
    copy.mkdir()
    parquet_dataset(copy, 4, 3)
    env = {"HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", f"import datasets; datasets.load_dataset({str(copy)!r}, split='train')"],
                   env=clean_env(env), check=True, capture_output=True)
    shutil.rmtree(copy)
    hub = ["data=hub", "data.name=toycorpus", "data.streams=2", "data.shuffle_buffer=2", "data.val_permille=250"]
    proc = train(tmp_path / "run", None, *STEPS[1:], "train.max_steps=2", *hub, env=env)
    assert "'toycorpus' has 1 data file(s), fewer than data.streams=2" in proc.stderr
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]
    proc = train(tmp_path / "absent", None, *STEPS, *hub[:1], "data.name=absentcorpus", env=env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cannot open data.name='absentcorpus'" in proc.stderr
    assert "it must be a local dataset folder, or a dataset already in the local datasets cache" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "absent").exists()
