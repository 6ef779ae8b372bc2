"""The client huggingface_hub sends a streamed dataset's requests with (train/data/hub_client.py), against the
Hub on loopback (tests/helpers/hub_server.py): a request that fails is sent again after the wait the reader or
the server asks for, a body that breaks off goes on from the byte it broke at, each retry is one warning and
counted, and a request that keeps failing ends as the DataUnavailable naming its URL. The bytes read are
compared with the file the server serves.
"""

from __future__ import annotations

import random

import pytest
from huggingface_hub.utils import httpx

from hub_server import loopback_hub, outage, reset, server_error, stall, too_many  # noqa: F401 (a fixture)
from train.data import reading
from train.data.hub_client import HubClient, HubUnreachable, _retry_after, unreachable
from train.data.reading import Reader

BLOB = "blob.bin"
SIZE = 2000


@pytest.fixture(scope="module")
def hub(loopback_hub, tmp_path_factory):
    folder = tmp_path_factory.mktemp("repo")
    (folder / BLOB).write_bytes(random.Random(0).randbytes(SIZE))
    return loopback_hub(folder)


@pytest.fixture
def waits(monkeypatch):
    slept = []
    monkeypatch.setattr(reading.time, "sleep", slept.append)
    return slept


def url(hub) -> str:
    return f"{hub.url}/datasets/{hub.repo}/resolve/main/{BLOB}"


def client(hub, retries: int = 3, wait_s: float = 0.01, timeout_s: float = 5.0) -> HubClient:
    return HubClient(Reader(retries, wait_s, timeout_s=timeout_s), httpx.URL(hub.url))


def warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpt3d: warning:")]


def test_a_body_that_stalls_goes_on_from_the_byte_it_stopped_at(hub, waits, capsys):
    data = (hub.folder / BLOB).read_bytes()
    hub.inject(stall(BLOB, at_byte=300, seconds=5))
    hub_client = client(hub, timeout_s=1.0)
    assert hub_client.get(url(hub)).content == data
    assert hub.asked == [("GET", BLOB, None), ("GET", BLOB, "bytes=300-")]
    assert hub_client.reader.made == 1 and len(hub.injected) == 1
    assert warnings(capsys) == [f"gpt3d: warning: data: {url(hub)} could not be read (nothing received in "
                                "data.read_timeout_s=1 s, 300 bytes into the body); retry 1 of 3 in 0.01 s"]


def test_a_reset_inside_a_range_goes_on_from_the_byte_it_broke_at(hub, waits, capsys):
    data = (hub.folder / BLOB).read_bytes()
    hub.inject(reset(BLOB, at_byte=1200))
    hub_client = client(hub)
    with hub_client.stream("GET", url(hub), headers={"range": "bytes=100-1999"}) as response:
        assert response.read() == data[100:]
    (line,) = warnings(capsys)
    received = int(line.split(", ")[-1].split(" bytes into the body")[0])  # what came before the reset
    assert "Connection reset by peer" in line and received <= 1100
    assert hub.asked == [("GET", BLOB, "bytes=100-1999"), ("GET", BLOB, f"bytes={100 + received}-1999")]
    assert hub_client.reader.made == 1


def test_429_waits_as_long_as_retry_after_says_and_5xx_the_doubling_wait(hub, waits, capsys):
    hub.inject(too_many(BLOB, retry_after=2), server_error(BLOB, 503), server_error(BLOB, 502))
    hub_client = client(hub)
    response = hub_client.get(url(hub))
    assert response.status_code == 200 and response.content == (hub.folder / BLOB).read_bytes()
    assert waits == [2.0, 0.02, 0.04] and hub_client.reader.made == 3
    assert [line.split(" could not be read ")[1] for line in warnings(capsys)] == [
        "(HTTP 429 Too Many Requests); retry 1 of 3 in 2 s",
        "(HTTP 503 Service Unavailable); retry 2 of 3 in 0.02 s",
        "(HTTP 502 Bad Gateway); retry 3 of 3 in 0.04 s",
    ]


def test_a_request_that_keeps_failing_ends_as_the_data_unavailable_naming_its_url(hub, waits):
    hub.inject(outage(lambda: True))
    with pytest.raises(HubUnreachable) as caught:
        client(hub, retries=2).get(url(hub))
    gone = caught.value.error
    assert (gone.path, gone.reason, gone.retries) == (url(hub), "HTTP 503 Service Unavailable", 2)
    assert len(hub.injected) == 3 and waits == [0.01, 0.02]  # the request, then its two retries
    try:  # as datasets raises it again: inside another error
        try:
            raise caught.value
        except HubUnreachable as err:
            raise FileNotFoundError("Couldn't find the dataset") from err
    except FileNotFoundError as wrapped:
        assert unreachable(wrapped) is gone
    assert unreachable(FileNotFoundError("no such file")) is None


def test_a_request_to_another_host_is_sent_as_it_is(hub, loopback_hub, tmp_path, waits):
    (tmp_path / BLOB).write_bytes(b"elsewhere")
    other = loopback_hub(tmp_path)
    other.inject(server_error(BLOB, 503))
    hub_client = client(hub)  # its Hub is `hub`
    assert hub_client.get(url(other)).status_code == 503
    assert hub_client.reader.made == 0 and len(other.injected) == 1


def test_retry_after_in_seconds_or_as_a_date():
    assert _retry_after("7") == 7.0
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date gone by: no wait
    assert 3000 < _retry_after(_in_an_hour()) <= 3600
    assert _retry_after("soon") is None and _retry_after(None) is None


def _in_an_hour() -> str:
    from datetime import datetime, timedelta, timezone
    from email.utils import format_datetime

    return format_datetime(datetime.now(timezone.utc) + timedelta(hours=1), usegmt=True)
