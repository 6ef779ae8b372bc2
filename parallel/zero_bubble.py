"""The ZB-H1 pipeline schedule (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): each stage's order
of work and messages, and the timeline it predicts.

Each micro batch's backward on a stage splits into B (the input gradient, which the previous stage
waits for) and W (the weight gradients, which only the optimizer step needs; model/weight_grads.py).
1F1B runs them as one pass; ZB-H1 runs B at once and moves W into time the stage would spend waiting.
With p stages, m micro batches and a stage's forward, B and W taking t_F, t_B, t_W:

    1F1B    step = (m + p − 1)·(t_F + t_B + t_W)            bubble (p − 1)/(m + p − 1) of the step
    ZB-H1   step = m·(t_F + t_B + t_W) + (p − 1)·(t_F + t_B − t_W)

(t_F = t_B = t_W: the bubble falls to a third), at about the activation memory of 1F1B: stage s keeps
at most p − s micro batches' activations, as in 1F1B, plus the inputs and output gradients of the W
passes it defers, at most s of them, so a later stage holds about what stage 0 holds under 1F1B (p micro
batches; bench.pipeline_memory measures the peak over stages).

The order (`stage_orders`) comes from a list schedule of the whole pipeline under the costs given:
forwards and B passes in 1F1B's order (p − s − 1 warm-up forwards on stage s, then one forward and one
B in turn); a W pass runs where the stage would otherwise wait for a message at least as long as the W
takes, or when stage s would otherwise hold more than s + 1 passes' deferred work; what is left runs
at the end. Under the costs it assumed it reaches the ZB-H1 step above exactly (tested for p ∈ {2, 4, 8}).

Messages (`stage_program`). Each stage sends its forward's output to the next and its B's input
gradient to the previous one, without waiting (isend), and posts each receive (irecv) before it needs
it. On each link (stage s, s + 1) both ends issue that link's messages in one agreed order, the order in
which the predicted timeline sends them, each end posting a receive right after its previous message on
the link. Point-to-point operations between two ranks then match one for one in issue order, which
NCCL needs (its sends and receives between a pair run in order on one stream) and gloo accepts; a
stage waits only for a receive, just before the pass that uses it. W passes hold no communication, so
moving them never changes a link's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from deepspeed.runtime.pipe import schedule as ds

FORWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "W"


@dataclass(frozen=True)
class Costs:
    """A stage's time for one micro batch's forward, B and W, in any one unit."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0

    def of(self, kind: str) -> float:
        return {FORWARD: self.forward, INPUT_GRAD: self.input_grad, WEIGHT_GRAD: self.weight_grad}[kind]


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """1F1B's order of forwards and backwards on `stage`: (kind, micro batch), backward as B."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [(FORWARD, j) for j in range(warmup)]
    for k in range(micro_batches - warmup):
        order += [(FORWARD, warmup + k), (INPUT_GRAD, k)]
    return order + [(INPUT_GRAD, k) for k in range(micro_batches - warmup, micro_batches)]


def _dependency(kind: str, stage: int, j: int, stages: int) -> tuple[str, int, int] | None:
    """The pass (kind, stage, micro batch) whose end this one waits for: the previous stage's forward,
    the next stage's B, or on the last stage its own forward."""
    if kind == FORWARD:
        return (FORWARD, stage - 1, j) if stage > 0 else None
    if kind == INPUT_GRAD:
        return (INPUT_GRAD, stage + 1, j) if stage < stages - 1 else (FORWARD, stage, j)
    return None


def stage_orders(stages: int, micro_batches: int, costs: Costs = Costs()) -> list[list[tuple[str, int]]]:
    """Every stage's ZB-H1 order of passes, [(kind, micro batch)] per stage (see the module docstring)."""
    forward_backward = [one_f_one_b(stages, micro_batches, s) for s in range(stages)]
    position, clock, ends = [0] * stages, [0.0] * stages, {}
    b_done, w_done = [0] * stages, [0] * stages
    orders: list[list[tuple[str, int]]] = [[] for _ in range(stages)]

    def run(s: int, kind: str, j: int, start: float) -> None:
        clock[s] = start + costs.of(kind)
        ends[(kind, s, j)] = clock[s]
        orders[s].append((kind, j))

    def weight(s: int) -> None:
        run(s, WEIGHT_GRAD, w_done[s], clock[s])
        w_done[s] += 1

    while any(position[s] < len(forward_backward[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(forward_backward[s]):
                if b_done[s] - w_done[s] > s:  # at most s + 1 passes of deferred work held
                    weight(s)
                    progressed = True
                    continue
                kind, j = forward_backward[s][position[s]]
                dependency = _dependency(kind, s, j, stages)
                if dependency is not None and dependency not in ends:
                    break  # not known yet: another stage first
                ready = ends[dependency] if dependency is not None else 0.0
                if b_done[s] > w_done[s] and ready - clock[s] >= costs.weight_grad:
                    weight(s)  # a W fits in the wait
                    progressed = True
                    continue
                run(s, kind, j, max(clock[s], ready))
                position[s] += 1
                b_done[s] += kind == INPUT_GRAD
                progressed = True
        if not progressed:
            raise RuntimeError("ZB-H1 list schedule made no progress")  # cannot happen for a valid 1F1B order
    for s in range(stages):
        orders[s] += [(WEIGHT_GRAD, j) for j in range(w_done[s], micro_batches)]
    return orders


def timeline(orders: list[list[tuple[str, int]]], costs: Costs) -> list[list[tuple[str, int, float, float]]]:
    """[(kind, micro batch, start, end)] per stage: each pass as soon as its stage is free and its input
    has arrived (messages take no time). A backward of 1F1B is one B here; give it t_B + t_W to time 1F1B."""
    stages = len(orders)
    position, clock, ends = [0] * stages, [0.0] * stages, {}
    passes: list[list[tuple[str, int, float, float]]] = [[] for _ in range(stages)]
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, j = orders[s][position[s]]
                dependency = _dependency(kind, s, j, stages)
                if dependency is not None and dependency not in ends:
                    break
                start = max(clock[s], ends[dependency] if dependency is not None else 0.0)
                clock[s] = ends[(kind, s, j)] = start + costs.of(kind)
                passes[s].append((kind, j, start, clock[s]))
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("these orders deadlock: a pass waits for one that never runs")
    return passes


def predicted_bubble(schedule: str, stages: int, micro_batches: int, costs: Costs = Costs()) -> float:
    """The mean over stages of 1 − (the stage's work) / (the step), for `schedule` ("1f1b" or "zb-h1")."""
    if schedule == "1f1b":
        whole = Costs(costs.forward, costs.input_grad + costs.weight_grad, 0.0)
        passes = timeline([one_f_one_b(stages, micro_batches, s) for s in range(stages)], whole)
    else:
        passes = timeline(stage_orders(stages, micro_batches, costs), costs)
    step = max(p[-1][3] for p in passes)
    work = micro_batches * (costs.forward + costs.input_grad + costs.weight_grad)
    return 1.0 - work / step


# ---- the program one stage runs on DeepSpeed's pipeline engine (parallel/zero_bubble_engine.py) ----


class Forward(ds.BufferOpInstruction):
    """The forward of buffer_id's micro batch, once its input's posted receive has arrived."""


class SendActivationAsync(ds.BufferOpInstruction):
    """Send buffer_id's output to the next stage without waiting for it to arrive."""


class SendGradAsync(ds.BufferOpInstruction):
    """Send buffer_id's input gradient to the previous stage without waiting for it to arrive."""


class PostRecvActivation(ds.BufferOpInstruction):
    """Post the receive of the previous stage's output for buffer_id (waited on by its forward)."""


class PostRecvGrad(ds.BufferOpInstruction):
    """Post the receive of the next stage's input gradient for buffer_id (waited on by its B)."""


class InputGradPass(ds.BufferOpInstruction):
    """B: the backward of buffer_id's micro batch, its weight gradients deferred (model/weight_grads.py)."""


class WeightGradPass(ds.PipeInstruction):
    """W: the oldest deferred weight gradients, accumulated into the parameters' gradients."""


class WaitSends(ds.PipeInstruction):
    """Wait for every send still in flight (before the step's gradient reductions and optimizer step)."""


def _link_messages(passes, stages: int, upper: int) -> list[tuple[str, int]]:
    """The agreed order of the messages on link (upper, upper + 1): ("act", j) from upper's forward,
    ("grad", j) from upper + 1's B, sorted by their predicted send time (ties: activations first)."""
    sent = [(end, 0, "act", j) for kind, j, _, end in passes[upper] if kind == FORWARD]
    sent += [(end, 1, "grad", j) for kind, j, _, end in passes[upper + 1] if kind == INPUT_GRAD]
    return [(what, j) for _, _, what, j in sorted(sent)]


@lru_cache(maxsize=64)
def stage_program(stages: int, micro_batches: int, stage: int, costs: Costs = Costs()) -> tuple[ds.PipeInstruction, ...]:
    """The instructions `stage` runs for one training step under ZB-H1 (see the module docstring); the
    buffer of micro batch j is j. Cached: the same every step (about 10 ms to schedule 96 micro batches
    through 16 stages)."""
    passes = timeline(stage_orders(stages, micro_batches, costs), costs)
    last = stages - 1
    # this stage's messages on each of its links, in the agreed order, as (is a send, micro batch)
    links = {}
    if stage > 0:
        links["prev"] = [(what == "grad", j) for what, j in _link_messages(passes, stages, stage - 1)]
    if stage < last:
        links["next"] = [(what == "act", j) for what, j in _link_messages(passes, stages, stage)]
    post = {"prev": PostRecvActivation, "next": PostRecvGrad}
    send = {"prev": SendGradAsync, "next": SendActivationAsync}
    cursor = dict.fromkeys(links, 0)
    posted: set[tuple[str, int]] = set()

    def receives_until_next_send(link: str) -> list[ds.PipeInstruction]:
        out = []
        while cursor[link] < len(links[link]) and not links[link][cursor[link]][0]:
            j = links[link][cursor[link]][1]
            out.append(post[link](j))
            posted.add((link, j))
            cursor[link] += 1
        return out

    program: list[ds.PipeInstruction] = []
    for link in links:
        program += receives_until_next_send(link)
    for kind, j, _, _ in passes[stage]:
        if kind == FORWARD:
            if stage > 0 and ("prev", j) not in posted:
                raise RuntimeError(f"stage {stage} would run forward {j} before posting its receive")
            if stage in (0, last):  # the first stage loads the inputs, the last pulls its (unused) labels
                program.append(ds.LoadMicroBatch(j))
            program.append(Forward(j))
        elif kind == INPUT_GRAD:
            if stage < last and ("next", j) not in posted:
                raise RuntimeError(f"stage {stage} would run B {j} before posting its receive")
            program.append(InputGradPass(j))
        else:
            program.append(WeightGradPass())
            continue
        link = "next" if kind == FORWARD else "prev"
        if link in links:
            if links[link][cursor[link]] != (True, j):
                raise RuntimeError(f"stage {stage}'s send of {kind}{j} is out of its link's agreed order")
            program.append(send[link](j))
            cursor[link] += 1
            program += receives_until_next_send(link)
    return (*program, WaitSends(), ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep())


class ZeroBubbleH1(ds.PipeSchedule):
    """DeepSpeed's PipeSchedule interface over `stage_program`: one step holding the whole program."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, costs: Costs = Costs()):
        super().__init__(micro_batches, stages, stage_id)
        self.costs = costs

    def steps(self):
        yield stage_program(self.stages, self.micro_batches, self.stage_id, self.costs)

    def num_pipe_buffers(self) -> int:
        return self.micro_batches
