"""A data file read again after it fails: retries with a doubling wait, each warned and counted, then
DataUnavailable naming the file (which the background workers send to the trainer whole)."""

import errno
import pickle

import pytest

from train.data import reading
from train.data.reading import DataUnavailable, Reader


@pytest.fixture
def waits(monkeypatch):
    slept = []
    monkeypatch.setattr(reading.time, "sleep", slept.append)
    return slept


def failing(times: int):
    """A read that fails `times` times with ENOENT, then returns the path."""
    calls = []

    def read(path):
        calls.append(path)
        if len(calls) <= times:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return path

    return read


def test_a_read_that_fails_twice_is_retried_twice(waits, capsys):
    reader = Reader(retries=3, wait_s=0.5)
    assert reader.call("/data/a.txt", failing(2)) == "/data/a.txt"
    assert waits == [0.5, 1.0] and reader.made == 2
    assert capsys.readouterr().err.splitlines() == [
        "gpt3d: warning: data: /data/a.txt could not be read (No such file or directory); retry 1 of 3 in 0.5 s",
        "gpt3d: warning: data: /data/a.txt could not be read (No such file or directory); retry 2 of 3 in 1 s",
    ]


def test_a_file_that_stays_unreadable_is_data_unavailable(waits):
    reader = Reader(retries=2, wait_s=0.1, warn=False)
    with pytest.raises(DataUnavailable) as caught:
        reader.call("/data/a.txt", failing(3))
    assert waits == [0.1, 0.2]
    err = caught.value
    assert str(err) == "data: /data/a.txt could not be read (No such file or directory), also after 2 retries"
    assert str(err.stopped("stopped after step 7")).endswith("retries; stopped after step 7")
    again = pickle.loads(pickle.dumps(err.stopped("x")))  # as a background worker sends it
    assert type(again) is DataUnavailable and (again.path, str(again)) == (err.path, str(err.stopped("x")))


def test_without_retries_the_first_failure_is_data_unavailable(waits):
    with pytest.raises(DataUnavailable):
        Reader().call("/data/a.txt", failing(1))
    assert waits == []


def test_a_wait_the_server_asks_for_is_kept_up_to_its_cap(waits):
    class Busy(OSError):
        def __init__(self, retry_after):
            super().__init__("busy")
            self.retry_after = retry_after

    reader, asked = Reader(retries=3, wait_s=0.5, warn=False), iter([2.0, 0.1, 1e9])

    def read(path):
        if reader.made < 3:
            raise Busy(next(asked))
        return path

    assert reader.call("https://hub/a.parquet", read) == "https://hub/a.parquet"
    assert waits == [2.0, 1.0, reading.RETRY_AFTER_MAX_S]  # the longer of the asked and the doubling wait
