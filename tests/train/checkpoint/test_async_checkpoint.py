"""Checkpoints written in the background (train.async_checkpoint=true) are the synchronous ones.

Gloo ranks run the whole training loop (train.run.loop.run) twice on one config, with synchronous and with
background saves: every file of every checkpoint must be the same bytes (a shard's header as JSON: the
safetensors library orders its metadata keys differently from one save to the next), while the writes ran
in the training thread in the first run and outside it in the second. A third run whose rank 0 cannot
publish (a full disk) stops on every rank with that error, at the end of the step the write failed in or
at the latest at its next save, leaving no folder behind.

Through `python -m train`, with the writer slowed by a `sitecustomize` audit hook (every file opened in
a checkpoint's temporary folder takes a while longer, in whichever thread opens it), a run killed with
SIGKILL during a background write keeps the previous checkpoint as `latest`, loses its partial folder
at the next start, and resumes on the loss curve of the one-process synchronous run; the pause a save
costs is logged and smaller than its write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli import REPO, arguments, assert_same_losses, clean_env, launcher, metrics, train, write_corpus
from distributed import run_distributed
from test_checkpoint_state import compose

from train.run.spec import resolve

RUN = ["train.max_steps=6", "train.checkpoint_interval=2", "logging.log_interval=1", "data.val_permille=250"]
# the same run through `python -m train` (cli.TINY and these, as test_checkpoint_state.compose has them)
CLI_RUN = ["model.n_head=4", "train.eval_interval=0", "logging.wandb.mode=disabled", "train.sample_tokens=0", *RUN,
           "train.async_checkpoint=true"]
STEPS = ["step00000002", "step00000004", "step00000006"]
SLOW_WRITE_S = 0.3
SLOW_WRITES = '''"""Test instrumentation: a file opened in a checkpoint's temporary folder takes GPT3D_SLOW_WRITE_S longer."""
import os
import sys
import time

_delay = float(os.environ["GPT3D_SLOW_WRITE_S"])


def _slow(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and "/.tmp-step" in os.fspath(args[0]):
        time.sleep(_delay)


sys.addaudithook(_slow)
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def both_ways(corpus: str, root: str, layout: list[str]) -> dict[str, list[bool]]:
    """The run with synchronous, then background saves (Python's `random`, which nothing in training
    seeds, seeded alike); for each, whether every checkpoint write ran in the training thread."""
    import random
    import threading

    from train.checkpoint import saving
    from train.run import loop

    in_main = []
    write = saving.write

    def recorded(*args, **kwargs):
        in_main.append(threading.current_thread() is threading.main_thread())
        return write(*args, **kwargs)

    saving.write = recorded
    found = {}
    for mode in ("false", "true"):
        random.seed(0)
        in_main.clear()
        run_dir = Path(root) / mode
        run_dir.mkdir(exist_ok=True)
        loop.run(resolve(compose(corpus, [*layout, *RUN, f"train.async_checkpoint={mode}"]), run_dir))
        found[mode] = list(in_main)

    def full_disk(tmp, final):
        raise OSError(28, "No space left on device")

    from train.checkpoint import CheckpointError, files

    files.publish = full_disk  # rank 0 cannot publish: every rank must hear it, at its next save
    run_dir = Path(root) / "full-disk"
    run_dir.mkdir(exist_ok=True)
    try:
        loop.run(resolve(compose(corpus, [*layout, *RUN, "train.async_checkpoint=true"]), run_dir))
    except CheckpointError as err:
        found["error"] = str(err)
    return found


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus) -> Path:
    """The run folders of `both_ways` in one process (one-process.false is the kill test's reference)."""
    root = tmp_path_factory.mktemp("one-process")
    check_both_ways(run_distributed(both_ways, 1, str(corpus), str(root), []), root, 1)
    return root


def check_both_ways(found: list[dict], root: Path, world: int) -> None:
    full = root / "full-disk"
    error = f"the checkpoint of step 2 does not fit in {full / 'checkpoints'} (No space left on device): it needs "
    assert all({**r, "error": r["error"][:len(error)]} == {"false": [True] * 3, "true": [False] * 3, "error": error}
               for r in found), found
    # the write of step 2 failed during step 3: raised at its end, or (written slowly) at the save of step 4
    assert [r["step"] for r in metrics(full)] in ([1, 2, 3], [1, 2, 3, 4])
    assert list((full / "checkpoints").iterdir()) == []  # nothing published, the temporary folder removed
    sync, background = root / "false" / "checkpoints", root / "true" / "checkpoints"
    for folder in (sync, background):
        assert sorted(p.name for p in folder.iterdir()) == ["latest", *STEPS]
        assert (folder / "latest").read_text() == "step00000006\n"
    for step in STEPS:
        assert contents(sync / step) == contents(background / step), step
        assert len(list((sync / step).glob("*.safetensors"))) == world


def test_background_saves_write_the_bytes_of_synchronous_ones_in_one_process(one_process):
    """The files are checked by the fixture; training itself does not notice the writer thread."""
    curves = [[(r["step"], r["train/loss"], r["train/grad_norm"]) for r in metrics(one_process / mode)]
              for mode in ("false", "true")]
    assert curves[0] == curves[1] and len(curves[0]) == 6


def test_background_saves_write_the_bytes_of_synchronous_ones_at_dp2_zero1(tmp_path, corpus):
    check_both_ways(run_distributed(both_ways, 2, str(corpus), str(tmp_path), ["parallel.zero_stage=1"]), tmp_path, 2)


def contents(folder: Path) -> dict:
    """Every file of a checkpoint folder as bytes, except where safetensors itself varies from one save to
    the next: the order of the keys in a shard's header metadata (a hash map's), so a shard is its header
    as JSON plus the exact bytes after it, and the manifest is its JSON without the shards' sha256."""
    found = {}
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        if file.suffix == ".safetensors":
            size = int.from_bytes(data[:8], "little")
            found[file.name] = (json.loads(data[8:8 + size]), data[8 + size:])
        elif file.name == "manifest.json":
            manifest = json.loads(data)
            for name, entry in manifest["files"].items():
                if name.endswith(".safetensors"):
                    del entry["sha256"]
            found[file.name] = manifest
        else:
            found[file.name] = data
    return found


def slowed(tmp_path: Path) -> dict:
    hook = tmp_path / "slow-writes"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SLOW_WRITES)
    return {"GPT3D_SLOW_WRITE_S": str(SLOW_WRITE_S),
            "PYTHONPATH": os.pathsep.join(p for p in [str(hook), os.environ.get("PYTHONPATH")] if p)}


def test_kill_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path, corpus, one_process):
    killed, log = tmp_path / "killed", tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*launcher("python", 1), *arguments(killed, corpus, *CLI_RUN)], cwd=REPO,
                                env=clean_env(slowed(tmp_path)), stdout=out, stderr=subprocess.STDOUT)
    root, deadline = killed / "checkpoints", time.monotonic() + 300
    partial = root / ".tmp-step00000004"
    while not partial.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)  # the write of step 4 takes seconds from here
    proc.wait()
    assert partial.is_dir(), log.read_text()[-3000:]
    assert (root / "latest").read_text() == "step00000002\n"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == ["step00000002"]

    resumed = train(killed, corpus, *CLI_RUN, env=slowed(tmp_path))
    assert "removed checkpoints/.tmp-step00000004: a save that was interrupted" in resumed.stdout
    assert f"resumed from {root / 'step00000002'} at step 2" in resumed.stdout
    assert sorted(p.name for p in root.iterdir()) == ["latest", *STEPS]
    got = metrics(killed)
    assert_same_losses(got, metrics(one_process / "false"))  # the uninterrupted run, saving synchronously

    saves = [r for r in got if r["step"] > 2 and r["perf/checkpoint_pause_s"] is not None]
    writes = [r["perf/checkpoint_write_s"] for r in got if r["step"] > 2 and r["perf/checkpoint_write_s"] is not None]
    # step 4's save is in the next record (a record is logged before its step's save), the last step's in its own
    assert [r["step"] for r in saves] == [5, 6] and all(r["perf/checkpoint_pause_s"] >= 0 for r in saves)
    # step 4's write (shard, its hashing, state.json, rng.json, manifest; alone or with step 6's) against
    # the pause of its save, which nothing was in flight before
    assert writes[0] > 4 * SLOW_WRITE_S and saves[0]["perf/checkpoint_pause_s"] < writes[0], got
