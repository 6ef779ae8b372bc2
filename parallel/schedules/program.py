"""The program a pipeline rank runs for one step on DeepSpeed's engine (parallel/schedules/engine.py): its
passes in the order of parallel/schedules/orders.py, with the messages between them.

Messages. A forward on virtual stage v sends its output to v + 1 and a B on v its input gradient to
v − 1; between two stages on one rank (the turn of a V) that is a hand-off in memory. Each rank sends
without waiting (isend) and posts each receive (irecv) before it needs it. The messages between two ranks,
in both directions and for all their chunks, go in one agreed order, the order in which the predicted
timeline sends them (ties: by kind, stage and micro batch), and each end posts a receive right after its
previous message with that peer. Point-to-point operations between two ranks then match one for one in
issue order, which NCCL needs (its sends and receives between a pair run in order on one stream) and
gloo accepts; a rank waits only for a receive, just before the pass that uses it. W passes hold no
communication, so moving them never changes a link's order.

Buffers. Micro batch j of a rank's chunk c lives in buffer c·m + j (m micro batches a step).
"""

from __future__ import annotations

from functools import lru_cache

from deepspeed.runtime.pipe import schedule as ds

from parallel.schedules.orders import (
    FORWARD,
    INPUT_GRAD,
    Costs,
    forward_orders,
    rank_orders,
    schedule_costs,
    timeline,
)
from parallel.schedules.placement import Placement


class Forward(ds.BufferOpInstruction):
    """The forward of virtual stage `stage` for buffer_id's micro batch, once its input has arrived."""


class SendActivationAsync(ds.BufferOpInstruction):
    """Send buffer_id's output to pipeline rank `peer` without waiting for it to arrive."""


class SendGradAsync(ds.BufferOpInstruction):
    """Send buffer_id's input gradient to pipeline rank `peer` without waiting for it to arrive."""


class HandOffActivation(ds.BufferOpInstruction):
    """buffer_id's output becomes the input of buffer `to` on this rank (the turn of a V)."""


class HandOffGrad(ds.BufferOpInstruction):
    """buffer_id's input gradient becomes the output gradient of buffer `to` on this rank."""


class PostRecvActivation(ds.BufferOpInstruction):
    """Post the receive, from pipeline rank `peer`, of the input for buffer_id (waited on by its forward)."""


class PostRecvGrad(ds.BufferOpInstruction):
    """Post the receive, from pipeline rank `peer`, of buffer_id's output gradient (waited on by its B)."""


class InputGradPass(ds.BufferOpInstruction):
    """B: the backward of virtual stage `stage` for buffer_id's micro batch; where the schedule splits W
    off, its weight gradients deferred (model/weight_grads.py)."""


class WeightGradPass(ds.PipeInstruction):
    """W: the oldest deferred weight gradients, accumulated into the parameters' gradients."""


class WaitSends(ds.PipeInstruction):
    """Wait for every send still in flight (before the step's gradient reductions and optimizer step)."""


def _messages(passes, placement: Placement) -> list[tuple[float, str, int, int, int, int]]:
    """Every message of the step: (send time, kind, receiving virtual stage, micro batch, from rank, to rank);
    kind "act" for a forward's output, "grad" for a B's input gradient."""
    out = []
    for rank_passes in passes:
        for kind, v, j, _, end in rank_passes:
            if kind == FORWARD and v < placement.stages - 1:
                out.append((end, "act", v + 1, j, placement.rank_of(v), placement.rank_of(v + 1)))
            elif kind == INPUT_GRAD and v > 0:
                out.append((end, "grad", v - 1, j, placement.rank_of(v), placement.rank_of(v - 1)))
    return sorted(out)


@lru_cache(maxsize=64)
def rank_program(schedule: str, placement: Placement, micro_batches: int, rank: int, costs: Costs = Costs(),
                 training: bool = True) -> tuple[ds.PipeInstruction, ...]:
    """The instructions pipeline rank `rank` runs for one step under `schedule` (evaluation: forwards only,
    `training`=False). Cached: the same every step (tens of milliseconds for 96 micro batches on 16 ranks)."""
    m = micro_batches
    if training:
        orders, played = rank_orders(schedule, placement, m, costs), schedule_costs(schedule, costs)
    else:
        orders, played = forward_orders(placement, m), costs
    passes = timeline(orders, played)

    def buffer(v: int, j: int) -> int:
        return placement.chunk_of(v) * m + j

    # this rank's messages with each peer, in the agreed order: (is a send, kind, receiving stage, micro batch)
    links: dict[int, list[tuple[bool, str, int, int]]] = {}
    for _, kind, v, j, source, target in _messages(passes, placement):
        if source != target and rank in (source, target):
            peer = target if source == rank else source
            links.setdefault(peer, []).append((source == rank, kind, v, j))
    cursor = dict.fromkeys(links, 0)
    posted: set[tuple[str, int, int]] = set()

    def receives_until_next_send(peer: int) -> list[ds.PipeInstruction]:
        out = []
        while cursor[peer] < len(links[peer]) and not links[peer][cursor[peer]][0]:
            _, kind, v, j = links[peer][cursor[peer]]
            post = PostRecvActivation if kind == "act" else PostRecvGrad
            out.append(post(buffer(v, j), peer=peer))
            posted.add((kind, v, j))
            cursor[peer] += 1
        return out

    def send(kind: str, v: int, j: int, to_stage: int) -> list[ds.PipeInstruction]:
        peer = placement.rank_of(to_stage)
        if peer == rank:
            hand_off = HandOffActivation if kind == "act" else HandOffGrad
            return [hand_off(buffer(v, j), to=buffer(to_stage, j))]
        if links[peer][cursor[peer]] != (True, kind, to_stage, j):
            raise RuntimeError(f"rank {rank}'s {kind} message to stage {to_stage} for micro batch {j} is out of "
                               f"its link's agreed order")
        cursor[peer] += 1
        instruction = SendActivationAsync if kind == "act" else SendGradAsync
        return [instruction(buffer(v, j), peer=peer), *receives_until_next_send(peer)]

    program: list[ds.PipeInstruction] = []
    for peer in links:
        program += receives_until_next_send(peer)
    last = placement.stages - 1
    for kind, v, j, _, _ in passes[rank]:
        if kind == FORWARD:
            if v > 0 and placement.rank_of(v - 1) != rank and ("act", v, j) not in posted:
                raise RuntimeError(f"rank {rank} would run forward {j} of stage {v} before posting its receive")
            if v == 0 or (v == last and placement.rank_of(0) != rank):  # inputs on the first, labels on the last
                program.append(ds.LoadMicroBatch(buffer(v, j)))
            program.append(Forward(buffer(v, j), stage=v))
            if v < last:
                program += send("act", v, j, v + 1)
        elif kind == INPUT_GRAD:
            if v < last and placement.rank_of(v + 1) != rank and ("grad", v, j) not in posted:
                raise RuntimeError(f"rank {rank} would run B {j} of stage {v} before posting its receive")
            program.append(InputGradPass(buffer(v, j), stage=v))
            if v > 0:
                program += send("grad", v, j, v - 1)
        else:
            program.append(WeightGradPass())
    if not training:
        return (*program, WaitSends())
    return (*program, WaitSends(), ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep())


class PipelineProgram(ds.PipeSchedule):
    """DeepSpeed's PipeSchedule interface over `rank_program`: one step holding the whole program."""

    def __init__(self, schedule: str, placement: Placement, micro_batches: int, rank: int, costs: Costs = Costs(),
                 training: bool = True):
        super().__init__(micro_batches, placement.pp, rank)
        self.schedule, self.placement, self.costs, self.training = schedule, placement, costs, training

    def steps(self):
        yield rank_program(self.schedule, self.placement, self.micro_batches, self.stage_id, self.costs, self.training)

    def num_pipe_buffers(self) -> int:
        return self.placement.virtual * self.micro_batches
