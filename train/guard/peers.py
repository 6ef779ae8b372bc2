"""Lost peers: a rank whose process or node is gone is noticed within train.peer_timeout_s, whatever the step is
doing, and every rank then exits with the watchdog's code, so that a launcher can start again without it.

A rank blocked in a collective with a dead peer learns nothing from gloo or NCCL when the peer's node vanished
without closing its connections (a power loss, a cut link): it would wait for train.step_timeout_s, or the
scheduler's own node timeout (SLURM's SlurmdTimeout, 300 s by default). So each rank beats: a daemon thread
writes a counter to the launch's rendezvous store (the TCP store at MASTER_ADDR:MASTER_PORT, through a client of
its own) every timeout/INTERVALS seconds, and watches one peer, the next rank in a ring, which covers every rank
with O(world) store traffic. A rank declares a loss when

- its peer's counter has not changed for train.peer_timeout_s (the peer's process died or stopped, or its node
  or link did), or
- none of its own store operations succeeded for that long (the store's host is the one that is gone), or
- another rank has declared one (the store's LOST key): every live rank leaves within one beat of the first.

Declaring: the lost peer's host name is appended to <run dir>/lost-nodes.txt (what launch/slurm.sbatch reads to
start again without that node), one line on stderr, exit code EXIT_CODE at once (os._exit: the main thread may
be inside a collective). The watch ends by itself once the process group is destroyed (a finished run's ranks
leave one by one, the store's host among them). One-process runs have no peers and no watch.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

from train.guard.watchdog import EXIT_CODE

INTERVALS = 8  # beats per timeout
LOST_KEY = "lost"
LOST_NODES = "lost-nodes.txt"


class PeerWatch:
    """Beat and watch the ring's next rank, from a daemon thread; `start` returns None for a one-process run."""

    def __init__(self, store, run_dir: Path, rank: int, world: int, timeout_s: float):
        self.store, self.path = store, Path(run_dir) / LOST_NODES
        self.rank, self.peer = rank, (rank + 1) % world
        self.timeout, self.interval = timeout_s, timeout_s / INTERVALS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gpt3d-peers", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, run_dir: Path, rank: int, world: int, timeout_s: float) -> PeerWatch | None:
        """Connect to the launch's store (MASTER_ADDR:MASTER_PORT, a client of this watch's own, under a prefix
        for this start) and begin beating."""
        import torch.distributed as dist

        if world == 1:
            return None
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s / INTERVALS),
                               wait_for_workers=False)
        # a restarted run (torchrun's agent keeps its store across restarts) must not read the last start's beats
        start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/" + os.environ.get("SLURM_STEP_ID", "0")
        store = dist.PrefixStore(f"gpt3d/peers/{start}/", client)
        store.set(f"host/{rank}", socket.gethostname())
        return cls(store, run_dir, rank, world, timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval * 2)

    def _watch(self) -> None:
        import torch.distributed as dist

        beat, seen, seen_at, ok_at = 0, None, time.monotonic(), time.monotonic()
        while not self._stop.wait(self.interval) and dist.is_initialized():
            now = time.monotonic()
            try:
                beat += 1
                self.store.set(f"beat/{self.rank}", str(beat))
                if self.store.check([LOST_KEY]):
                    self._leave(self.store.get(LOST_KEY).decode(), None)
                value = self.store.get(f"beat/{self.peer}") if self.store.check([f"beat/{self.peer}"]) else None
                ok_at = now
            except Exception:  # the store's host is unreachable (or gone): counted below, not fatal at once
                value = seen
            if value != seen:
                seen, seen_at = value, now
            if self._stop.is_set() or not dist.is_initialized():
                return
            if now - seen_at > self.timeout:
                host = self._host(self.peer)
                self._leave(f"rank {self.peer} (host {host}) sent no heartbeat for {now - seen_at:.0f} s", host)
            if now - ok_at > self.timeout:
                self._leave(f"the rendezvous store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                            f"has not answered for {now - ok_at:.0f} s (its host is gone)",
                            os.environ.get("MASTER_ADDR"))

    def _host(self, rank: int) -> str:
        try:
            return self.store.get(f"host/{rank}").decode() if self.store.check([f"host/{rank}"]) else "?"
        except Exception:
            return "?"

    def _leave(self, why: str, host: str | None) -> None:
        """Say why, record the lost host, tell the other ranks, exit; never returns."""
        if host is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as file:
                file.write(f"{host}\n")
            try:
                self.store.set(LOST_KEY, f"rank {self.rank} lost a peer: {why}")
            except Exception:
                pass
        os.write(2, (f"gpt3d: error: rank {self.rank}: {why}; a peer's process or node is gone "
                     f"(train.peer_timeout_s); exiting with code {EXIT_CODE}\n").encode())
        os._exit(EXIT_CODE)
