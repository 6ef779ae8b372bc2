"""A Hugging Face Hub on loopback for tests: one dataset repository, served over HTTP on 127.0.0.1, answering
what `huggingface_hub` asks when `datasets` streams it, and failing where a test says.

It answers, for the repository `repo`, made of the files of one folder:

- ``GET /api/datasets/<repo>`` and ``…/revision/<rev>``: the repository's info (its commit, its files);
- ``GET /api/datasets/<repo>/tree/<rev>[/<folder>]``: the file tree (one page);
- ``HEAD`` / ``GET /datasets/<repo>/resolve/<rev>/<file>``: a file, whole or an HTTP range of it (206);

and 404 to anything else. `env()` gives the environment that points huggingface_hub at it (HF_ENDPOINT), with
caches of the test's own and offline mode off, so a process started with it reads the repository from here
and from nowhere else.

`Fault`s, set by `inject`, meet the requests they match, in order, each the first `times` of them (None:
every one from its start on: an outage): an HTTP status (429 with Retry-After, 500, 502, 503), a connection
reset in the middle of a body, or a stall in it longer than the client's read timeout; per request (every
request of a file) or per byte (the requests whose range holds byte `at_byte` of the file, whose body is cut
there). Each fault met is one line of `injected`, and each request of a file is recorded in `asked`.
Every request is answered or cut within `STALL_LIMIT_S`, an idle connection is dropped after `IDLE_S`, and
`close()` (the fixture's teardown) wakes any stall and stops the server.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import struct
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pytest

IDLE_S = 10  # a kept-alive connection with no request for this long is closed
STALL_LIMIT_S = 60  # the longest a stall may hold a request
RESET_AFTER_S = 0.3  # a reset comes this long after the part of the body sent before it


@dataclass
class Fault:
    """How some requests fail (see the module docstring); `times`: how many it meets (None: all from `when` on)."""

    kind: str  # "status" | "reset" | "stall"
    file: str | None = None  # the file whose requests it meets; None: every request
    status: int = 503
    retry_after: int | None = None  # 429: the Retry-After header, seconds
    at_byte: int | None = None  # reset / stall: where the body is cut (only requests whose range holds it)
    seconds: float = 0.0  # stall: how long
    times: int | None = 1
    when: Callable[[], bool] | None = None  # it starts once this is true (None: at once)

    def matches(self, file: str | None, first: int, last: int) -> bool:
        """Whether a request for bytes [first, last] of `file` (None: not a file) is one this fault meets now."""
        if self.times == 0 or (self.file is not None and file != self.file):
            return False
        if self.at_byte is not None and not first <= self.at_byte <= last:
            return False
        return self.when is None or self.when()

    def line(self, method: str, path: str) -> str:
        what = {"status": f"HTTP {self.status}", "reset": f"reset at byte {self.at_byte}",
                "stall": f"stall of {self.seconds:g} s at byte {self.at_byte}"}[self.kind]
        return f"{what}: {method} {path}"


def too_many(file: str, retry_after: int = 1, times: int = 1) -> Fault:
    """429 Too Many Requests with Retry-After for the next `times` requests of `file`."""
    return Fault("status", file, 429, retry_after, times=times)


def server_error(file: str, status: int = 503, times: int = 1) -> Fault:
    """A 5xx status for the next `times` requests of `file`."""
    return Fault("status", file, status, times=times)


def reset(file: str, at_byte: int) -> Fault:
    """The connection reset after byte `at_byte` of `file` was asked for and `at_byte` bytes of it sent."""
    return Fault("reset", file, at_byte=at_byte)


def stall(file: str, at_byte: int, seconds: float) -> Fault:
    """The body of `file` stopping at byte `at_byte` for `seconds`, then the connection closed."""
    return Fault("stall", file, at_byte=at_byte, seconds=seconds)


def outage(when: Callable[[], bool], status: int = 503) -> Fault:
    """Every request answered with `status` once `when()` is true, until the faults are lifted."""
    return Fault("status", None, status, times=None, when=when)


class LoopbackHub:
    """The dataset repository `repo` made of the files of `folder`, served on 127.0.0.1 (module docstring)."""

    def __init__(self, folder: Path, repo: str, home: Path):
        self.folder, self.repo, self.home = Path(folder), repo, Path(home)
        self.files = sorted(p.name for p in self.folder.iterdir() if p.is_file())
        self.commit = hashlib.sha1("".join(self.files).encode() + b"".join(
            (self.folder / f).read_bytes() for f in self.files)).hexdigest()
        self.faults: list[Fault] = []
        self.injected: list[str] = []
        self.asked: list[tuple[str, str, str | None]] = []  # each request of a file: method, file, Range header
        self.lock, self.stopping = threading.Lock(), threading.Event()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def env(self) -> dict:
        """The environment of a process that streams `repo` from here (and can reach no other Hub)."""
        return {"HF_ENDPOINT": self.url, "HF_HOME": str(self.home), "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0",
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "", "HF_DATASETS_CACHE": str(self.home / "datasets")}

    def inject(self, *faults: Fault) -> None:
        """From now on, these faults (and no other); `injected` and `asked` start empty."""
        with self.lock:
            self.faults, self.injected, self.asked = list(faults), [], []

    def lift(self) -> None:
        """No fault any more (the Hub is back)."""
        with self.lock:
            self.faults = []

    def fault_for(self, method: str, path: str, file: str | None, first: int, last: int) -> Fault | None:
        """The fault that meets this request (counted and recorded), or None."""
        with self.lock:
            for fault in self.faults:
                if fault.matches(file, first, last):
                    if fault.times is not None:
                        fault.times -= 1
                    self.injected.append(fault.line(method, path))
                    return fault
        return None

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def info(self) -> dict:
        return {"id": self.repo, "sha": self.commit, "private": False, "disabled": False, "gated": False,
                "siblings": [{"rfilename": f} for f in self.files], "tags": [], "downloads": 0, "likes": 0,
                "lastModified": "2024-01-01T00:00:00.000Z", "cardData": {}}

    def tree(self) -> list[dict]:
        return [{"type": "file", "path": f, "size": (self.folder / f).stat().st_size,
                 "oid": hashlib.sha1((self.folder / f).read_bytes()).hexdigest()} for f in self.files]


class _Server(ThreadingHTTPServer):
    """A thread per connection, none waited for at the end; a client that went away (a run that stopped, a
    connection the client dropped) is no error of the server's."""

    daemon_threads, block_on_close = True, False

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler(hub: LoopbackHub) -> type:
    """The request handler class of `hub`'s server."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = IDLE_S

        def log_message(self, *args) -> None:  # quiet: the test's output is the run's
            pass

        def do_HEAD(self) -> None:
            self.answer(head=True)

        def do_GET(self) -> None:
            self.answer(head=False)

        def answer(self, head: bool) -> None:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            api, files = f"/api/datasets/{hub.repo}", f"/datasets/{hub.repo}/resolve/"
            if re.fullmatch(rf"{re.escape(api)}(/revision/[^/]+)?", path):
                return self.whole(json.dumps(hub.info()).encode(), head, path)
            tree = re.fullmatch(rf"{re.escape(api)}/tree/[^/]+(/.+)?", path)
            if tree:
                if tree.group(1):  # a folder: the repository has none
                    return self.send(404, b'{"error": "no such folder"}', head, {"X-Error-Code": "EntryNotFound"})
                return self.whole(json.dumps(hub.tree()).encode(), head, path)
            name = path.removeprefix(files).partition("/")[2] if path.startswith(files) else None
            if name in hub.files:
                return self.file(name, head, path)
            self.send(404, b'{"error": "not found"}', head, {"X-Error-Code": "EntryNotFound"} if name else {})

        def whole(self, body: bytes, head: bool, path: str) -> None:
            """An API answer, unless a fault meets it."""
            fault = hub.fault_for(self.command, path, None, 0, len(body) - 1)
            if fault is not None:
                return self.fail(fault, body, 0, head)
            self.send(200, body, head, {"Content-Type": "application/json"})

        def file(self, name: str, head: bool, path: str) -> None:
            """A file, or the range of it asked for, unless a fault meets it."""
            data = (hub.folder / name).read_bytes()
            first, last, ranged = 0, len(data) - 1, self.headers.get("Range")
            with hub.lock:
                hub.asked.append((self.command, name, ranged))
            if ranged:
                a, _, b = ranged.removeprefix("bytes=").partition("-")
                first, last = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
            headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": hub.commit,
                       "Accept-Ranges": "bytes"}
            if ranged:
                headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
            body = data[first : last + 1]
            fault = hub.fault_for(self.command, path, name, first, last)
            if fault is not None:
                return self.fail(fault, body, first, head, 206 if ranged else 200, headers)
            self.send(206 if ranged else 200, body, head, headers)

        def fail(self, fault: Fault, body: bytes, first: int, head: bool, status: int = 200,
                 headers: dict | None = None) -> None:
            """Meet `fault`: a status, or the body (of a request whose range starts at byte `first` of the file)
            cut at the fault's byte, then the connection reset, or held still for the fault's seconds."""
            if fault.kind == "status":
                retry = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
                return self.send(fault.status, b'{"error": "injected"}', head, retry)
            self.close_connection = True
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            cut = 0 if fault.at_byte is None or head else fault.at_byte - first
            self.wfile.write(body[:cut])
            self.wfile.flush()
            if fault.kind == "stall":
                hub.stopping.wait(min(fault.seconds, STALL_LIMIT_S))
            else:  # once the client has the bytes sent (a reset drops what it has not read), SO_LINGER 0: closing
                hub.stopping.wait(RESET_AFTER_S)  # sends a reset, not an orderly end
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()

        def send(self, status: int, body: bytes, head: bool, headers: dict) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

    return Handler


@pytest.fixture(scope="module")
def loopback_hub(tmp_path_factory):
    """`serve(folder, repo)`: a `LoopbackHub` of the files in `folder`, stopped when the module's tests end."""
    hubs = []

    def serve(folder: Path, repo: str = "gpt3d/loopback") -> LoopbackHub:
        hubs.append(LoopbackHub(folder, repo, tmp_path_factory.mktemp("hf-home")))
        return hubs[-1]

    yield serve
    for hub in hubs:
        hub.close()
