"""Damaged, incomplete and crafted checkpoints: detected before use, reported in one line, never run.

One run (one process, 6 steps, a checkpoint after every step, keep_checkpoints=3, keep_every=2)
leaves step00000002, 4, 5 and 6. Copies of it are damaged the ways a disk, a killed job or a
hostile user would; `select` (which checkpoint a resume uses) must pass over each damaged one with
one warning and take the newest intact one, and `python -m train` must then continue exactly as
the undamaged run did, or stop with one clear error when none is intact. A file that would run
code if unpickled is never unpickled.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from cli import metrics, train
from train.checkpoint import integrity as checkpoint
from train.checkpoint.files import step_tag

RUN = ["train.eval_interval=0", "logging.wandb.mode=disabled", "train.checkpoint_interval=1",
       "train.keep_checkpoints=3", "train.keep_every=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train(run_dir, corpus, *RUN, "train.max_steps=6")
    return run_dir


@pytest.fixture
def run(tmp_path, trained) -> Path:
    """A fresh copy of the trained run to damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


class Marker:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def shard(run_dir: Path, step: int) -> Path:
    return sorted((run_dir / "checkpoints" / step_tag(step)).glob("*.safetensors"))[0]


def forge_manifest(folder: Path) -> None:
    """Rewrite the manifest to match the files as they now are (a hostile user's move)."""
    from train.checkpoint.files import MANIFEST, describe

    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"] = {name: describe(folder / name) for name in manifest["files"]}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def choose(run_dir: Path) -> tuple[str, list[str]]:
    """(the step folder a resume takes, the warnings printed)."""
    warnings = []
    folder, _ = checkpoint.select(run_dir / "checkpoints", warn=warnings.append)
    return folder.name, warnings


def test_retention_keeps_the_newest_and_every_kth(trained):
    root = trained / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step00000002", "step00000004", "step00000005",
                                                       "step00000006"]
    assert (root / "latest").read_text().strip() == "step00000006"


def test_an_intact_run_resumes_from_its_newest_checkpoint_silently(trained):
    assert choose(trained) == ("step00000006", [])


def test_garbage_in_the_middle_of_a_file(run):
    file = shard(run, 6)
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(bytes(range(256)) * 16)  # 4 KB
    chosen, warnings = choose(run)
    assert chosen == "step00000005" and len(warnings) == 1
    assert "step00000006" in warnings[0] and "does not match its checksum" in warnings[0]


def test_a_truncated_file(run):
    file = shard(run, 6)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 3])
    chosen, warnings = choose(run)
    assert chosen == "step00000005" and len(warnings) == 1 and "the manifest says" in warnings[0]


def test_a_deleted_file(run):
    shard(run, 6).unlink()
    chosen, warnings = choose(run)
    assert chosen == "step00000005" and len(warnings) == 1 and "is missing" in warnings[0]


@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00garbled", b"step00000099\n"], ids=["empty", "garbled", "dangling"])
def test_a_bad_latest_file_still_finds_the_newest_intact_checkpoint(run, content):
    (run / "checkpoints" / "latest").write_bytes(content)
    chosen, warnings = choose(run)
    assert chosen == "step00000006" and len(warnings) == 1 and "latest" in warnings[0]


def test_an_interrupted_save_is_never_taken(run):
    partial = run / "checkpoints" / ".tmp-step00000007"
    partial.mkdir()
    shutil.copy(shard(run, 6), partial)
    assert choose(run) == ("step00000006", [])


def test_a_crafted_pickle_is_refused_without_running(run, tmp_path):
    marker = tmp_path / "pwned"
    folder = run / "checkpoints" / "step00000006"
    shard(run, 6).write_bytes(pickle.dumps(Marker(marker)))
    forge_manifest(folder)  # the checksums now match the crafted file
    chosen, warnings = choose(run)
    assert chosen == "step00000005" and "is not a safetensors file" in warnings[0]
    assert not marker.exists()


def test_a_forged_state_file_is_refused(run):
    folder = run / "checkpoints" / "step00000006"
    (folder / "state.json").write_text('{"format": "something else", "step": 6}')
    forge_manifest(folder)
    chosen, warnings = choose(run)
    assert chosen == "step00000005" and "state.json is not a gpt3d-checkpoint state" in warnings[0]


def test_a_deepspeed_checkpoint_with_a_crafted_pickle_is_refused_without_running(tmp_path):
    """The old format's files are pickles (DeepSpeed loads them with weights_only=False): never read."""
    marker = tmp_path / "pwned"
    old = tmp_path / "checkpoints" / "step00000002"
    old.mkdir(parents=True)
    (old / "mp_rank_00_model_states.pt").write_bytes(pickle.dumps(Marker(marker)))
    (tmp_path / "checkpoints" / "latest").write_text("step00000002")
    with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint .* no manifest.json"):
        checkpoint.select(tmp_path / "checkpoints", warn=lambda text: None)
    with pytest.raises(checkpoint.CheckpointError, match="no manifest.json"):
        checkpoint.tag_folder(old)
    assert not marker.exists()


def test_resume_skips_damaged_checkpoints_and_continues_exactly(run, corpus, tmp_path):
    """Garbage in step 6, a crafted pickle in step 5 with a forged manifest, step 4's `latest` gone
    and an interrupted save left over: the run resumes from step 4 with one warning per damaged
    checkpoint, its first save removes the leftover, and it logs steps 5 and 6 exactly as the
    undamaged run did."""
    expected = metrics(run)
    marker = tmp_path / "pwned"
    with open(shard(run, 6), "r+b") as f:
        f.seek(1000)
        f.write(b"\x00" * 4096)
    shard(run, 5).write_bytes(pickle.dumps(Marker(marker)))
    forge_manifest(run / "checkpoints" / "step00000005")
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / ".tmp-step00000007").mkdir()
    proc = train(run, corpus, *RUN, "train.max_steps=6")
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("gpt3d: warning:")]
    assert len(warnings) == 3, warnings  # latest missing, step 6 and step 5 damaged
    assert "resumed from" in proc.stdout and "step00000004 at step 4" in proc.stdout
    assert not (run / "checkpoints" / ".tmp-step00000007").exists() and not marker.exists()
    keys = ("step", "train/loss", "train/lr", "train/grad_norm")
    assert [[r[k] for k in keys] for r in metrics(run)] == [[r[k] for k in keys] for r in expected]


def test_damaged_tensor_bytes_found_at_load_fall_back_and_continue_exactly(run, corpus):
    """Garbage in the tensor data of step 6's shard (its header and JSON files intact): the checks made
    before the build hash no shard, so they choose step 6; loading hashes the shards on every rank
    together, finds it damaged, warns once and resumes from step 5 (the checkpoint's schedule), and step 6
    is logged exactly as the undamaged run logged it. The run goes on to step 7: run again at step 6, a
    finished run says so and loads nothing (test_first_hour.py)."""
    expected = metrics(run)
    file = shard(run, 6)
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size - 4096)  # the last tensor's bytes, far past the header
        f.write(bytes(range(256)) * 16)
    proc = train(run, corpus, *RUN, "train.max_steps=7")
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("gpt3d: warning:")]
    damaged = [line for line in warnings if "step00000006" in line]
    assert len(damaged) == 1 and "does not match its checksum" in damaged[0], warnings
    assert "step00000005 at step 5" in proc.stdout
    keys = ("step", "train/loss", "train/lr", "train/grad_norm")
    assert [[r[k] for k in keys] for r in metrics(run)][:6] == [[r[k] for k in keys] for r in expected]


def test_no_intact_checkpoint_is_one_clear_error_never_a_fresh_start(run, corpus):
    for step in (2, 4, 5, 6):
        shard(run, step).unlink()
    before = (run / "metrics.jsonl").read_text()
    proc = train(run, corpus, *RUN, "train.max_steps=8", check=False)
    assert proc.returncode == 2  # refused before the run starts
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gpt3d: error:")]
    assert len(errors) == 1 and "no intact checkpoint in" in errors[0] and "Traceback" not in proc.stderr
    assert (run / "metrics.jsonl").read_text() == before  # nothing trained, nothing logged


def test_another_model_shape_is_one_clear_error_before_any_work(run, corpus):
    proc = train(run, corpus, *RUN, "train.max_steps=8", "model.d_model=64", "model.n_layer=2", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "holds another model: it was saved with model.d_model=32 (now 64), model.n_layer=3 (now 2)" in proc.stderr
    assert "model toy" not in proc.stdout  # stopped before the model was built
