"""Lost peers: a rank whose process or node is gone is noticed within about train.peer_timeout_s, whatever the
step is doing, and every rank then exits with the watchdog's code, so that a launcher can start again without it.

A rank blocked in a collective with a dead peer learns nothing from gloo or NCCL when the peer's node vanished
without closing its connections (a power loss, a cut link): it would wait for train.step_timeout_s, or the
scheduler's own node timeout (SLURM's SlurmdTimeout, 300 s by default). So each rank beats: a daemon thread
writes a counter to the launch's rendezvous store (the TCP store at MASTER_ADDR:MASTER_PORT, through a client of
its own) every timeout/INTERVALS seconds, and watches one peer, the next rank in a ring, which covers every rank
with O(world) store traffic. A rank declares a loss when

- its peer's counter has not changed for train.peer_timeout_s (the peer's process died or stopped, or its node
  or link did), or
- none of its own store operations succeeded for that long (the store's host is gone, or this rank's link), or
- another rank has declared one (the store's LOST_KEY): every rank that still reaches the store leaves within a
  beat of the first.

Declaring: the lost host is appended to the file GPT3D_LOST_NODES names (default <run dir>/lost-nodes.txt; what
launch/slurm.sbatch reads to start again without that node): the silent peer's SLURM node name or host name, or
MASTER_ADDR when the store is what went silent. Then one line on stderr and exit code EXIT_CODE at once
(os._exit: the main thread may be inside a collective). The watch ends with the process group (a finished
run's ranks leave one by one, the store's host among them) or, at the latest, at the process's exit (atexit).
One-process runs have no watch.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

from train.guard.watchdog import EXIT_CODE

INTERVALS = 8  # beats per timeout
LOST_KEY = "lost"
LOST_NODES = "lost-nodes.txt"


def host_name() -> str:
    """This rank's node as the launcher names it: SLURM's node name under srun, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class PeerWatch:
    """Beats and watches the ring's next rank from a daemon thread (`start`: None for a one-process run)."""

    def __init__(self, connect, lost_file: Path, rank: int, world: int, timeout_s: float):
        """`connect(timeout_s)`: a fresh client of the store, under this start's prefix."""
        self.connect, self.lost_file = connect, lost_file
        self.rank, self.peer = rank, (rank + 1) % world
        self.timeout_s, self.interval_s = timeout_s, timeout_s / INTERVALS
        self.store = connect(timeout_s)
        self.store.set(f"host/{rank}", host_name())
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gpt3d-peers", daemon=True)
        self._thread.start()
        atexit.register(self._stop)

    def _stop(self) -> None:
        """At the process's exit: the thread ends and the store's client is released here, in the main thread,
        before the interpreter and torch's C++ objects are torn down under a thread still using them."""
        self._stopped.set()
        self._thread.join(timeout=2 * self.interval_s + 1)
        self.store = None

    @classmethod
    def start(cls, run_dir: Path, rank: int, world: int, timeout_s: float) -> PeerWatch | None:
        """Connect to the launch's store (MASTER_ADDR:MASTER_PORT) under a prefix every rank of this process group
        shares and no earlier start used (rank 0 draws it, a broadcast gives it to all), and begin beating."""
        import torch.distributed as dist

        if world == 1:
            return None
        token = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

        def connect(timeout: float):
            client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                                   wait_for_workers=False)
            return dist.PrefixStore(f"gpt3d/peers/{token[0]}/", client)

        lost_file = Path(os.environ.get("GPT3D_LOST_NODES") or Path(run_dir) / LOST_NODES)
        return cls(connect, lost_file, rank, world, timeout_s)

    def _watch(self) -> None:
        import torch.distributed as dist

        beat, seen, seen_at, ok_at = 0, None, time.monotonic(), time.monotonic()
        while dist.is_initialized() and not self._stopped.wait(self.interval_s):
            now = time.monotonic()
            try:
                if self.store is None:  # a call timed out: its late reply must not answer the next one
                    self.store = self.connect(self.interval_s)
                beat += 1
                self.store.set(f"beat/{self.rank}", str(beat))
                if self.store.check([LOST_KEY]):
                    self._leave(self.store.get(LOST_KEY).decode(), None)
                value = self.store.get(f"beat/{self.peer}") if self.store.check([f"beat/{self.peer}"]) else None
                ok_at = now
            except Exception:  # the store's host is unreachable, or gone: counted below, not fatal at once
                self.store, value = None, seen
            if value != seen:
                seen, seen_at = value, now
            if self._stopped.is_set() or not dist.is_initialized():
                return
            if now - seen_at > self.timeout_s:
                host = self._host(self.peer)
                self._leave(f"rank {self.peer} (host {host}) sent no heartbeat for {now - seen_at:.0f} s", host)
            if now - ok_at > self.timeout_s:
                master = os.environ.get("MASTER_ADDR", "?")
                self._leave(f"the rendezvous store at {master}:{os.environ.get('MASTER_PORT')} has not answered "
                            f"for {now - ok_at:.0f} s (its host, or this rank's link, is gone)", master)

    def _host(self, rank: int) -> str:
        try:
            return self.store.get(f"host/{rank}").decode() if self.store.check([f"host/{rank}"]) else "?"
        except Exception:
            return "?"

    def _leave(self, why: str, host: str | None) -> None:
        """Say why, record the lost host, tell the other ranks, exit; never returns."""
        if host is not None:
            self.lost_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.lost_file, "a") as file:
                file.write(f"{host}\n")
            try:
                self.store.set(LOST_KEY, f"rank {self.rank} lost a peer: {why}")
            except Exception:
                pass
        os.write(2, (f"gpt3d: error: rank {self.rank}: {why}; a peer's process or node is gone "
                     f"(train.peer_timeout_s); exiting with code {EXIT_CODE}\n").encode())
        os._exit(EXIT_CODE)
