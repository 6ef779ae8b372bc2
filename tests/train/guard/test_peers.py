"""Lost peers (train/guard/peers.py) on real gloo ranks: a rank that leaves without a word is reported by the one
watching it within about train.peer_timeout_s, with its host, and the others follow through the store; a rank
whose main thread holds the interpreter for several timeouts (a long step) is not taken for dead."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch.distributed as dist
from distributed import RankFailed, run_distributed

TIMEOUT_S = 2.0


def leave_silently(folder: str, leaving: int) -> str:
    """Rank `leaving` exits at once, its process group never destroyed (as a killed process); the others wait."""
    from train.guard.peers import PeerWatch, host_name

    os.environ["GPT3D_LOST_NODES"] = f"{folder}/lost.txt"
    PeerWatch.start(folder, dist.get_rank(), dist.get_world_size(), TIMEOUT_S)
    if dist.get_rank() == leaving:
        os._exit(0)
    time.sleep(10 * TIMEOUT_S)  # the watch ends this rank before
    return host_name()


def test_a_silent_rank_is_reported_with_its_host_and_its_watcher_exits_3(tmp_path):
    with pytest.raises(RankFailed) as failed:
        run_distributed(leave_silently, 2, str(tmp_path), 1, timeout=120)
    message = str(failed.value)
    assert "rank 0 of 2 raised (exit code 3)" in message
    assert "rank 0: rank 1 (host " in message and "sent no heartbeat" in message
    from train.guard.peers import host_name

    assert (tmp_path / "lost.txt").read_text() == f"{host_name()}\n"
    silent = float(re.search(r"sent no heartbeat for (\d+) s", message)[1])
    assert TIMEOUT_S <= silent <= TIMEOUT_S + 1  # noticed at the timeout, a beat or two after


def test_every_rank_leaves_once_one_declared_a_loss(tmp_path):
    with pytest.raises(RankFailed) as failed:  # rank 1 watches rank 2; rank 0 watches rank 1, alive
        run_distributed(leave_silently, 3, str(tmp_path), 2, timeout=120)
    message = str(failed.value)
    assert "rank 0 of 3 raised (exit code 3)" in message
    assert "rank 0: rank 1 lost a peer: rank 2 (host " in message


def hold_the_interpreter(seconds: float) -> bool:
    """A pure-Python loop on every rank for `seconds` (the GIL held but for the interpreter's switches)."""
    from train.guard.peers import PeerWatch

    PeerWatch.start("/nonexistent", dist.get_rank(), dist.get_world_size(), TIMEOUT_S)
    end, total = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        total += sum(range(1000))
    dist.barrier()
    return total > 0


def test_a_long_step_holding_the_interpreter_is_not_a_death():
    assert run_distributed(hold_the_interpreter, 2, 4 * TIMEOUT_S, timeout=120) == [True, True]
