"""The disk under the checkpoints: the pre-flight warning (the free space stubbed), and the one line a
save the file system refused stops the run with."""

import errno
import shutil
from pathlib import Path

import pytest

from train.checkpoint import storage
from train.checkpoint.storage import SaveFailed, StorageError

MB = 1_000_000


@pytest.fixture
def free(monkeypatch):
    """Set the free bytes the file system under any path reports."""
    reported = {}
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 0, reported["free"]))
    return reported


def preflight(root: Path, keep: int) -> list[str]:
    said = []
    storage.preflight(root, 20 * MB, keep, said.append)
    return said


def test_warns_when_retention_and_the_save_in_flight_do_not_fit(tmp_path, free):
    free["free"] = 79 * MB  # keep 3 + 1 being written: 80 MB
    (line,) = preflight(tmp_path / "checkpoints", keep=3)
    assert line == (f"{tmp_path / 'checkpoints'} has 79.0 MB free, less than the 80.0 MB its checkpoints need "
                    "(train.keep_checkpoints=3 of 20.0 MB each and the one a save writes before the oldest goes); free "
                    "space there, lower train.keep_checkpoints, or move the run folder to a larger disk and resume "
                    "there (hydra.run.dir=<new folder>)")
    free["free"] = 80 * MB
    assert preflight(tmp_path / "checkpoints", keep=3) == []


def test_checkpoints_already_there_need_no_more_space(tmp_path, free):
    for step in (2, 4):
        (tmp_path / f"step{step:08d}").mkdir()
    free["free"] = 40 * MB  # a resumed run: 2 of the 3 kept are on disk, 2 more at the peak
    assert preflight(tmp_path, keep=3) == []
    free["free"] = 39 * MB
    assert "40.0 MB its checkpoints need (train.keep_checkpoints=3 of 20.0 MB each and the one a save writes " \
           "before the oldest goes, 2 already there)" in preflight(tmp_path, keep=3)[0]


@pytest.mark.parametrize("number, words", [(errno.ENOSPC, "does not fit in"), (errno.EROFS, "cannot be written in")])
def test_a_save_the_file_system_refused_is_one_line(tmp_path, free, number, words):
    free["free"] = 5 * MB
    failed = SaveFailed(8, OSError(number, "refused", str(tmp_path / ".tmp-step00000008" / "shard.safetensors")))
    err = storage.cannot_save(failed, tmp_path, 20 * MB, 3, tmp_path / "step00000006")
    assert isinstance(err, StorageError) and "\n" not in str(err)
    assert str(err).startswith(f"the checkpoint of step 8 {words} {tmp_path} (refused): it needs 20.0 MB, 5.0 MB free; "
                               f"the newest checkpoint, {tmp_path / 'step00000006'}, is kept; ")


def test_any_other_failure_stays_what_it_was(tmp_path):
    failed = SaveFailed(8, RuntimeError("ranks disagree"))
    assert storage.cannot_save(failed, tmp_path, 20 * MB, 3, None) is failed


def test_of_several_ranks_errors_the_storage_error_speaks():
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("DCP write failed")
    wrapped.__cause__ = full
    assert storage.first_cause([RuntimeError("a rank gave up"), wrapped]) is full
    other = ValueError("bad")
    assert storage.first_cause([other]) is other
