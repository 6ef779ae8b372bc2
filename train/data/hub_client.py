"""The HTTP client `huggingface_hub` uses while gpt3d streams a dataset from the Hub: each request retried,
resumed and timed out by the run's data settings, each retry one warning and counted.

`datasets` streams a Hub dataset through `huggingface_hub` (HfFileSystem: the repository's info and file
tree, then HTTP range requests of its files), which sends every request through one client per process.
`use(reader)` makes that client a `HubClient` reading through `reader` (train/data/reading.py); of its
requests, those to the Hub (HF_ENDPOINT, and where it redirects them) are:

- a request to the Hub that fails before its body (a connection refused or dropped, no answer within
  ``reader.timeout_s``, or the statuses RETRIED: 408, 429, 500, 502, 503, 504) is sent again, after the
  reader's doubling wait or the server's ``Retry-After``, whichever is longer;
- a body that breaks off (a reset, a stall past ``reader.timeout_s``) is asked for again from the byte
  where it broke (an HTTP range), so what the caller reads is the body as it would have come whole;
- each retry is one warning line and counted in ``reader.made``; a request still failing after
  ``reader.retries`` retries raises `HubUnreachable`, carrying the DataUnavailable that names its URL.

So huggingface_hub's and datasets' own retry loops never see a failure (they would retry each request
another 5 times after waits of up to 8 s, and print two lines per retry), and `HubUnreachable` is of no
class they catch: it reaches the reader of the dataset, where `unreachable()` takes the DataUnavailable
back out of whatever `datasets` wrapped it in. Every retry budget is per request (`reader.retries`), so a
request ends after at most that many retries, each waiting at most ``reader.timeout_s`` for a byte.
"""

from __future__ import annotations

from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Iterator

from huggingface_hub.utils import httpx  # the HTTP library huggingface_hub sends with (httpx2 from its 2.0 on)

from train.data.reading import DataUnavailable, Reader

RETRIED = frozenset({408, 429, 500, 502, 503, 504})  # statuses that say "not now" rather than "no"
BROKEN = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)  # a connection that failed


class HubError(OSError):
    """One failed attempt at a Hub request: why, and how long the server asked to wait (None: it did not)."""

    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.strerror, self.retry_after = reason, retry_after


class HubUnreachable(Exception):
    """A Hub request that failed after its last retry, carrying the DataUnavailable naming its URL; of no
    class that huggingface_hub, datasets or pyarrow catch, so it reaches the reader of the dataset."""

    def __init__(self, error: DataUnavailable):
        super().__init__(str(error))
        self.error = error


def use(reader: Reader) -> None:
    """Make huggingface_hub send its requests to the Hub (HF_ENDPOINT), in this process, through a
    `HubClient` reading through `reader`; with huggingface_hub's own request hook and redirects, as its
    default client has."""
    import huggingface_hub
    from huggingface_hub import constants

    hooks = huggingface_hub.get_session().event_hooks
    endpoint = httpx.URL(constants.ENDPOINT)
    huggingface_hub.set_client_factory(lambda: HubClient(reader, endpoint, event_hooks=hooks, follow_redirects=True,
                                                         timeout=None))


def unreachable(err: BaseException) -> DataUnavailable | None:
    """The DataUnavailable of the `HubUnreachable` that `err` is or was raised from (datasets re-raises some
    errors as its own), or None when `err` has nothing to do with one."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, HubUnreachable):
            return err.error
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


class HubClient(httpx.Client):
    """huggingface_hub's client, sending each request to the Hub at `endpoint` through `reader` (see the module
    docstring); a request elsewhere (a lookup `datasets` may make of other hosts, and can do without) is sent
    as the default client sends it."""

    def __init__(self, reader: Reader, endpoint: httpx.URL, **kwargs):
        super().__init__(**kwargs)
        self.reader, self.endpoint = reader, endpoint

    def send(self, request: httpx.Request, *, stream: bool = False, **kwargs) -> httpx.Response:
        """`request` sent, again while it fails; its body read unless `stream`, resumed where it breaks."""
        if (request.url.scheme, request.url.host, request.url.port) != (self.endpoint.scheme, self.endpoint.host,
                                                                        self.endpoint.port):
            return super().send(request, stream=stream, **kwargs)
        if self.reader.timeout_s is not None:
            request.extensions = {**request.extensions, "timeout": httpx.Timeout(self.reader.timeout_s).as_dict()}
        response, attempt = self.answer(request, 0, 0, kwargs)
        response.stream = ResumedBody(self, request, response.stream, attempt, kwargs)
        if not stream:
            try:
                response.read()
            except BaseException:
                response.close()
                raise
        return response

    def answer(self, request: httpx.Request, start: int, attempt: int, kwargs: dict) -> tuple[httpx.Response, int]:
        """The response to `request` from byte `start` of its body on, its headers read, sent again while it
        fails; and the retries made so far (from `attempt`)."""
        while True:
            try:
                return self._attempt(request, start, kwargs), attempt
            except HubError as err:
                attempt = self.failed(str(request.url), err, attempt)

    def _attempt(self, request: httpx.Request, start: int, kwargs: dict) -> httpx.Response:
        """One try at `request`'s response from byte `start` of its body on (a range request when start > 0);
        HubError when it fails."""
        sent = request if start == 0 else _from_byte(request, start)
        try:
            response = super().send(sent, stream=True, **kwargs)
        except BROKEN as err:
            raise HubError(_why(err, self.reader.timeout_s)) from None
        if response.status_code in RETRIED:
            response.close()
            raise HubError(f"HTTP {response.status_code} {response.reason_phrase}",
                           _retry_after(response.headers.get("Retry-After")))
        if start and _range_start(response.headers.get("Content-Range")) != _range_start(sent.headers["Range"]):
            response.close()
            raise HubError(f"asked to go on from byte {start} of the body, the server answered HTTP "
                           f"{response.status_code} {response.headers.get('Content-Range', 'without a range')}")
        return response

    def failed(self, url: str, err: HubError, attempt: int) -> int:
        """The reader's retry (warned, counted, waited for); HubUnreachable when the retries are spent."""
        try:
            return self.reader.failed(url, err, attempt)
        except DataUnavailable as gone:
            raise HubUnreachable(gone) from None


class ResumedBody(httpx.SyncByteStream):
    """A response body that, where it breaks off, goes on from a new response to the same request asked
    from the byte it broke at."""

    def __init__(self, client: HubClient, request: httpx.Request, first: httpx.SyncByteStream, attempt: int,
                 kwargs: dict):
        self.client, self.request, self.kwargs = client, request, kwargs
        self.stream, self.attempt = first, attempt

    def __iter__(self) -> Iterator[bytes]:
        received = 0
        while True:
            try:
                for chunk in self.stream:
                    received += len(chunk)
                    yield chunk
                return
            except BROKEN as err:
                self.stream.close()
                why = HubError(f"{_why(err, self.client.reader.timeout_s)}, {received} bytes into the body")
                self.attempt = self.client.failed(str(self.request.url), why, self.attempt)
                response, self.attempt = self.client.answer(self.request, received, self.attempt, self.kwargs)
                self.stream = response.stream

    def close(self) -> None:
        self.stream.close()


def _from_byte(request: httpx.Request, start: int) -> httpx.Request:
    """`request` asking for its body from byte `start` on: its own range moved on by `start`, else `start-`."""
    first, _, last = request.headers.get("Range", "bytes=0-").removeprefix("bytes=").partition("-")
    headers = request.headers.copy()
    headers["Range"] = f"bytes={int(first) + start}-{last}"  # replaces a `range` header of any case
    return httpx.Request(request.method, request.url, headers=headers, content=request.content,
                          extensions=request.extensions)


def _range_start(value: str | None) -> int | None:
    """The first byte of a Range ("bytes=A-B") or Content-Range ("bytes A-B/N") header; None without one."""
    if not value:
        return None
    try:
        return int(value.replace("=", " ").split()[1].split("-")[0])
    except (IndexError, ValueError):
        return None


def _why(err: Exception, timeout_s: float | None) -> str:
    """A failed connection in words."""
    if isinstance(err, httpx.TimeoutException):
        return f"nothing received in data.read_timeout_s={timeout_s:g} s" if timeout_s is not None else "timed out"
    return str(err) or type(err).__name__


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait by a Retry-After header (seconds, or an HTTP date); None without a usable one."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max((parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds(), 0.0)
    except (TypeError, ValueError):
        return None
