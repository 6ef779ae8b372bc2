"""Where a rank's chunks come from: packed on the calling thread, or ahead of time by worker processes.

Both supplies hand out the chunks of each lane in order (`get(lane, index)`), so what a rank trains on
never depends on which one runs or on timing; the resume state lives with the consumer
(`train.data.TrainBatches`), and chunks packed ahead but not yet taken are simply packed again after
a resume.

`WorkerPool`: ``workers`` processes (spawned, so safe beside CUDA and process groups), each owning
some of the rank's lanes and keeping up to ``prefetch`` chunks of each ready ahead of what the rank
has taken. A worker packs next the lane whose next chunk is needed soonest (estimated from the
mixture weights); it never runs more than ``prefetch`` ahead on any lane, and a lane the consumer waits
for always has room, so it cannot deadlock. A worker's error reaches the consumer as the same
`DataError` (a file that stayed unreadable as the same DataUnavailable, when the consumer asks for the
chunk that needed it); a worker that dies is reported with its exit code. A worker whose rank is gone
(killed, with no chance to stop it) stops by itself.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import queue
import signal
import traceback

from train.data.reading import Reader
from train.data.sources import DataError, DataSpec
from train.data.streams import Chunk, LanePacker, LaneState

POLL_S = 0.5  # how often a waiting consumer checks that its worker is alive; also an idle worker's longest nap


class InlineSupply:
    """Chunks packed on demand, on the calling thread."""

    def __init__(self, spec: DataSpec, lanes: dict, seq_len: int, seed: int, warn: bool = True):
        warned: set = set()  # bad files already named, over all lanes
        reader = Reader.of(spec, warn)  # one for all lanes (streams.LanePacker)
        start = {lane: copy.deepcopy(state) for lane, state in lanes.items()}  # the caller's states move on
        self._make = lambda lane: LanePacker(spec, lane, seq_len, seed, start[lane], reader, warn, warned)
        self._packers: dict = {}

    def get(self, lane: tuple[int, int], index: int) -> Chunk:
        if lane not in self._packers:
            self._packers[lane] = self._make(lane)
        chunk = self._packers[lane].next_chunk()
        assert chunk.index == index, (lane, chunk.index, index)
        return chunk

    def close(self) -> None:
        self._packers.clear()


class WorkerPool:
    """Chunks packed ahead by `workers` processes; lanes are dealt to workers round-robin."""

    def __init__(self, spec: DataSpec, lanes: dict, seq_len: int, seed: int, warn: bool = True):
        ctx = mp.get_context("spawn")
        order = sorted(lanes)
        self.slot = {lane: k for k, lane in enumerate(order)}
        n = min(spec.workers, len(order))
        self.owner = {lane: k % n for k, lane in enumerate(order)}
        size = spec.chunk_windows
        self.taken = ctx.Array("q", [lanes[lane].served // size for lane in order], lock=False)  # next chunk wanted
        self.stop = ctx.Event()
        self.queues = [ctx.Queue() for _ in range(n)]
        self.wake = [ctx.Event() for _ in range(n)]  # set when the consumer takes one of the worker's chunks
        self.stash: dict = {lane: {} for lane in order}
        self.procs = []
        for w in range(n):
            mine = {lane: lanes[lane] for lane in order if self.owner[lane] == w}
            args = (spec, mine, self.slot, seq_len, seed, warn, self.queues[w], self.taken, self.wake[w], self.stop)
            proc = ctx.Process(target=_work, args=args, name=f"gpt3d-data-{w}", daemon=True)
            proc.start()
            self.procs.append(proc)

    def get(self, lane: tuple[int, int], index: int) -> Chunk:
        w, ready = self.owner[lane], self.stash[lane]
        while index not in ready:
            try:
                message = self.queues[w].get(timeout=POLL_S)
            except queue.Empty:
                if not self.procs[w].is_alive():
                    raise DataError(
                        f"data: background worker {w} exited with code {self.procs[w].exitcode}; "
                        "rerun with data.workers=0 to see the failure on the training thread"
                    ) from None
                continue
            if message[0] == "error":
                raise message[1]
            got_lane, chunk = message
            self.stash[got_lane][chunk.index] = chunk
        self.taken[self.slot[lane]] = index + 1
        self.wake[w].set()
        return ready.pop(index)

    def close(self) -> None:
        if not self.procs:
            return
        self.stop.set()
        for wake in self.wake:
            wake.set()
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()  # it ignores SIGTERM
                proc.join(timeout=5)
        for q in self.queues:
            q.cancel_join_thread()
            q.close()
        self.procs = []


def _work(spec: DataSpec, lanes: dict, slot: dict, seq_len: int, seed: int, warn: bool, out, taken, wake, stop) -> None:
    """A worker's loop: pack the most urgent of its lanes that is fewer than `prefetch` chunks ahead, until
    told to stop or its rank has exited.

    Stop signals (a terminal's Ctrl-C, a scheduler's SIGTERM / SIGUSR1 to every process of the job)
    are for the training process, which finishes its step and then stops the workers itself."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    try:
        warned, reader = set(), Reader.of(spec, warn)
        packers = {lane: LanePacker(spec, lane, seq_len, seed, state, reader, warn, warned)
                   for lane, state in lanes.items()}
        weight = {lane: spec.weights[lane[0]] for lane in lanes}
        rank = mp.parent_process()
        while not stop.is_set() and rank.is_alive():
            wake.clear()  # before looking: a chunk taken after this sets it again, so no wake-up is lost
            ahead = [lane for lane, p in packers.items() if p.index - taken[slot[lane]] < spec.prefetch]
            if not ahead:
                wake.wait(POLL_S)
                continue
            # the stream position where the lane's next chunk starts to be needed, about
            lane = min(ahead, key=lambda lane: (packers[lane].index / weight[lane], lane))
            out.put((lane, packers[lane].next_chunk()))
        out.cancel_join_thread()  # stopped: nobody reads the chunks still queued, so exit without flushing them
    except DataError as e:  # the error itself (a DataUnavailable stays one), raised again by the consumer
        out.put(("error", e))
    except BaseException as e:  # anything else: the consumer raises it with the worker's traceback
        out.put(("error", DataError(f"data: background worker failed: {e!r}\n{traceback.format_exc()}")))


def make_supply(spec: DataSpec, lanes: dict[tuple[int, int], LaneState], seq_len: int, seed: int, warn: bool = True):
    """The supply `spec.workers` asks for, starting each lane at its state."""
    cls = WorkerPool if spec.workers > 0 else InlineSupply
    return cls(spec, lanes, seq_len, seed, warn)
