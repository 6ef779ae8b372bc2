"""Bad input on the command line: one line on stderr, exit code 2, nothing on disk, also under torchrun
(only rank 0 prints). The expected suggestions are written out here from configs/ as a user reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli import train


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_step=5", "gpt3d: error: train.max_step is not a setting; did you mean train.max_steps? valid keys of train: ["),
        ("optim.lrr=1e-3", "gpt3d: error: optim.lrr is not a setting; did you mean optim.lr? "),
        ("data.pathz=[a.txt]", "gpt3d: error: data.pathz is not a setting; did you mean data.paths? "),
        ("model=gpt3-125", "gpt3d: error: model=gpt3-125: there is no model config 'gpt3-125'; did you mean model=gpt3-125m? "
                           "model is one of ['gpt3-1.3b', 'gpt3-125m', "),
        ("parallel=fast", "gpt3d: error: parallel=fast: parallel is a section of settings, not one value; set its keys, "
                          "e.g. parallel.layout=…; valid keys of parallel: ['activation_checkpointing', "),
        ("train.max_steps=[", "gpt3d: error: cannot read the command-line argument 'train.max_steps=['"),
    ],
)
def test_a_bad_override_is_one_line_and_exit_2(tmp_path, override, message):
    run_dir = tmp_path / "run"
    proc = train(run_dir, None, "data.paths=[none.txt]", override, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(message) and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not run_dir.exists()


def test_a_run_folder_through_a_file_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "notes.txt").write_text("a file\n")
    proc = train(tmp_path / "notes.txt" / "run", None, "data.paths=[none.txt]", check=False)
    assert proc.returncode == 2
    assert proc.stderr == (f"gpt3d: error: run folder {tmp_path}/notes.txt/run: {tmp_path}/notes.txt is a file, not a "
                           "folder; choose hydra.run.dir=PATH under a folder\n")


def test_under_torchrun_only_rank_0_prints_the_error(tmp_path):
    proc = train(tmp_path / "run", None, "data.paths=[none.txt]", "train.max_step=5", kind="torchrun", nproc=2, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("gpt3d: error:") == 1 and "exitcode  : 2" in proc.stderr


def test_a_run_folder_where_no_folder_can_be_made_is_one_line_and_exit_2():
    proc = train(Path("/proc/gpt3d-run"), None, "data.paths=[none.txt]", check=False)
    assert proc.returncode == 2
    assert proc.stderr == ("gpt3d: error: run folder /proc/gpt3d-run: cannot create folders in /proc (No such file or "
                           "directory); choose hydra.run.dir=PATH in a writable folder\n")
