"""Pipeline schedules as orders of passes: what each pipeline rank runs, in which order, for one step.

A pass is (kind, virtual stage, micro batch) (parallel/schedules/placement.py for virtual stages). Each
micro batch's backward on a virtual stage splits into B (the input gradient, which the previous stage
waits for) and W (the weight gradients, which only the optimizer step needs; model/weight_grads.py).
Schedules that do not split run the whole backward as one B (costed t_B + t_W). With p ranks, m micro
batches, V chunks a rank and a chunk's forward, B and W taking t_F, t_B, t_W (a whole rank's work for a
micro batch: V·(t_F + t_B + t_W)):

    1f1b         one chunk; p − s − 1 warm-up forwards on stage s, then one forward and one backward
                 in turn; step (m + p − 1)·(t_F + t_B + t_W), bubble (p − 1)/(m + p − 1)
    zb-h1        1F1B's forwards and B's, each W moved into time the stage would wait (Qi et al., 2023);
                 step m·(t_F + t_B + t_W) + (p − 1)·(t_F + t_B − t_W)
    interleaved  V chunks in a loop (Narayanan et al., 2021, Megatron-LM's order): micro batches in groups
                 of p, each group through chunk 0, then chunk 1, …; (p − s − 1)·2 + (V − 1)·p warm-up
                 forwards on rank s, then 1F1B over chunks; bubble (p − 1)/(V·m + p − 1), m a multiple of p
    zb-v         2 chunks in a V (Qi et al., 2024): rank s holds virtual stages s and 2p − 1 − s, so the
                 first rank also holds the loss; a list schedule of F, B and W (`list_orders`) that runs
                 a ready B first, then a forward (a new micro batch only while the rank holds fewer than
                 2p chunks' activations, 1F1B's peak of p whole stages), and W in the time it would wait;
                 with equal passes it reaches the bound below

Whatever the schedule, the last rank's first input arrives after p − 1 chunk forwards, so the step is at
least (p − 1)·t_F + V·m·(t_F + t_B + t_W).

`timeline` plays any orders under given costs (messages take no time): the step it predicts and each
pass's start and end, from which parallel/schedules/program.py derives the order of messages and the
planner its bubble (train/planner/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallel.schedules.placement import LOOP, V_SHAPE, Placement

FORWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "W"
ONE_F_ONE_B, ZB_H1, INTERLEAVED, ZB_V = "1f1b", "zb-h1", "interleaved", "zb-v"
SCHEDULES = (ONE_F_ONE_B, ZB_H1, INTERLEAVED, ZB_V)
SPLIT_BACKWARD = (ZB_H1, ZB_V)

Pass = tuple[str, int, int]  # (kind, virtual stage, micro batch)


@dataclass(frozen=True)
class Costs:
    """A chunk's time for one micro batch's forward, B and W, in any one unit."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0

    def of(self, kind: str) -> float:
        return {FORWARD: self.forward, INPUT_GRAD: self.input_grad, WEIGHT_GRAD: self.weight_grad}[kind]

    def unsplit(self) -> Costs:
        """The costs of a schedule whose B is the whole backward (B and W as one pass)."""
        return Costs(self.forward, self.input_grad + self.weight_grad, 0.0)


def placement_of(schedule: str, pp: int, virtual: int = 1) -> Placement:
    """Where `schedule` puts the virtual stages: zb-v in a V (2 chunks a rank), the others in a loop."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}: must be one of {list(SCHEDULES)}")
    if schedule == ZB_V:
        return Placement(pp, 2, V_SHAPE)
    return Placement(pp, virtual if schedule == INTERLEAVED else 1, LOOP)


def dependency(kind: str, stage: int, j: int, stages: int) -> Pass | None:
    """The pass whose end (kind, stage, j) waits for: the previous stage's forward, the next stage's B,
    or on the last stage its own forward; a W follows its own B on its rank (the order holds it)."""
    if kind == FORWARD:
        return (FORWARD, stage - 1, j) if stage > 0 else None
    if kind == INPUT_GRAD:
        return (INPUT_GRAD, stage + 1, j) if stage < stages - 1 else (FORWARD, stage, j)
    return None


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[Pass]:
    """1F1B's order of forwards and backwards on `stage` (one chunk a rank): (kind, stage, j), backward as B."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [(FORWARD, stage, j) for j in range(warmup)]
    for k in range(micro_batches - warmup):
        order += [(FORWARD, stage, warmup + k), (INPUT_GRAD, stage, k)]
    return order + [(INPUT_GRAD, stage, k) for k in range(micro_batches - warmup, micro_batches)]


def interleaved(placement: Placement, micro_batches: int, rank: int) -> list[Pass]:
    """Megatron-LM's interleaved 1F1B on `rank` (see the module docstring); V = 1 is 1F1B."""
    pp, chunks, m = placement.pp, placement.virtual, micro_batches
    if chunks == 1:
        return one_f_one_b(pp, m, rank)
    if m % pp:
        raise ValueError(f"the interleaved schedule runs micro batches in groups of pp={pp}: {m} micro batches a step "
                         f"do not divide into them (make the micro batches per step a multiple of {pp})")
    stages = placement.stages_of(rank)

    def unit(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, pp * chunks)
        chunk = within // pp
        return stages[chunks - 1 - chunk if backward else chunk], group * pp + within % pp

    total = m * chunks
    warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)
    order = [(FORWARD, *unit(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [(FORWARD, *unit(warmup + k, False)), (INPUT_GRAD, *unit(k, True))]
    return order + [(INPUT_GRAD, *unit(k, True)) for k in range(total - warmup, total)]


def zb_h1(stages: int, micro_batches: int, costs: Costs = Costs()) -> list[list[Pass]]:
    """Every stage's ZB-H1 order: 1F1B's forwards and B's, with the W passes placed by a list schedule.

    A W pass runs where the stage would otherwise wait for a message at least as long as the W takes,
    or when stage s would otherwise hold more than s + 1 passes' deferred work; what is left runs at the
    end. Under the costs it assumed it reaches ZB-H1's step exactly (tested for p ∈ {2, 4, 8})."""
    forward_backward = [one_f_one_b(stages, micro_batches, s) for s in range(stages)]
    position, clock, ends = [0] * stages, [0.0] * stages, {}
    b_done, w_done = [0] * stages, [0] * stages
    orders: list[list[Pass]] = [[] for _ in range(stages)]

    def run(s: int, kind: str, j: int, start: float) -> None:
        clock[s] = start + costs.of(kind)
        ends[(kind, s, j)] = clock[s]
        orders[s].append((kind, s, j))

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
                kind, _, j = forward_backward[s][position[s]]
                needs = dependency(kind, s, j, stages)
                if needs is not None and needs not in ends:
                    break  # not known yet: another stage first
                ready = ends[needs] if needs is not None else 0.0
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
        orders[s] += [(WEIGHT_GRAD, s, j) for j in range(w_done[s], micro_batches)]
    return orders


def list_orders(placement: Placement, micro_batches: int, costs: Costs, split: bool = True) -> list[list[Pass]]:
    """Each rank's order from a list schedule of the whole pipeline (zb-v; `split`=False: forward only, as
    evaluation runs). Time advances pass by pass; each step runs, of the passes some rank could start
    earliest, by priority: a B whose input is there (the latest virtual stage first), then a forward (the
    latest stage first; a forward of a rank's first chunk only while it holds fewer than 2·pp chunks'
    activations in flight), and a W (the oldest B's)
    when nothing else could start on the rank before the W would end, or when the rank holds pp deferred W
    passes. W passes run in their B's order."""
    stages, m, pp = placement.stages, micro_batches, placement.pp
    ranks = range(pp)
    clock = [0.0] * pp
    ends: dict[Pass, float] = {}
    next_f = dict.fromkeys(range(stages), 0)  # per virtual stage: the next micro batch to forward
    next_b = dict.fromkeys(range(stages), 0)
    deferred: list[list[Pass]] = [[] for _ in ranks]  # B's whose W has not run, oldest first
    in_flight = [0] * pp  # chunks' activations held: forwards whose B has not run
    orders: list[list[Pass]] = [[] for _ in ranks]
    limit = 2 * pp
    total = sum(len(placement.stages_of(r)) for r in ranks) * m * (3 if split else 1)

    def candidates(r: int) -> list[tuple[float, int, Pass]]:
        """(start, priority, pass) of each pass `r` could run next whose input's end is known."""
        found = []
        for chunk, v in enumerate(placement.stages_of(r)):
            if split and next_b[v] < next_f[v]:
                j = next_b[v]
                needs = dependency(INPUT_GRAD, v, j, stages)
                if needs in ends:
                    found.append((max(clock[r], ends[needs]), -v, (INPUT_GRAD, v, j)))
            if next_f[v] < m and (chunk > 0 or in_flight[r] < limit or not split):  # a later chunk: always
                j = next_f[v]
                needs = dependency(FORWARD, v, j, stages)
                if needs is None or needs in ends:
                    start = max(clock[r], ends[needs] if needs else 0.0)
                    found.append((start, stages - v, (FORWARD, v, j)))
        return found

    def option(r: int) -> tuple | None:
        """(start, rank, priority, pass) of what `r` would run next, or None while it waits on an unknown end."""
        found = candidates(r)
        first = min((start for start, _, _ in found), default=math.inf)
        held_back = len(deferred[r]) >= pp  # a rank holds at most pp deferred W passes
        if deferred[r] and (first - clock[r] >= costs.weight_grad or first == math.inf or held_back):
            return clock[r], r, 2 * stages + 1, (WEIGHT_GRAD, *deferred[r][0][1:])
        if found:
            start, priority, chosen = min(x for x in found if x[0] == first)
            return start, r, priority, chosen
        return None

    options = [option(r) for r in ranks]  # each rank's next pass, recomputed when it or a neighbour ran one
    for _ in range(total):
        best = min((o for o in options if o is not None), key=lambda o: o[:3], default=None)
        if best is None:
            raise RuntimeError("the list schedule made no progress")  # cannot happen: some pass is always ready
        start, r, _, (kind, v, j) = best
        clock[r] = ends[(kind, v, j)] = start + costs.of(kind)
        orders[r].append((kind, v, j))
        if kind == FORWARD:
            next_f[v] += 1
            in_flight[r] += split
        elif kind == INPUT_GRAD:
            next_b[v] += 1
            in_flight[r] -= 1
            deferred[r].append((kind, v, j))
        else:
            deferred[r].pop(0)
        waiting = {r}  # the ranks whose next pass this one's end may start
        if kind == FORWARD and v + 1 < stages:
            waiting.add(placement.rank_of(v + 1))
        if kind == INPUT_GRAD and v > 0:
            waiting.add(placement.rank_of(v - 1))
        for w in waiting:
            options[w] = option(w)
    return orders


def rank_orders(schedule: str, placement: Placement, micro_batches: int, costs: Costs = Costs()) -> list[list[Pass]]:
    """Every pipeline rank's order of passes for one training step under `schedule`."""
    pp, m = placement.pp, micro_batches
    if schedule == ONE_F_ONE_B:
        return [one_f_one_b(pp, m, s) for s in range(pp)]
    if schedule == ZB_H1:
        return zb_h1(pp, m, costs)
    if schedule == INTERLEAVED:
        return [interleaved(placement, m, r) for r in range(pp)]
    return list_orders(placement, m, costs)


def forward_orders(placement: Placement, micro_batches: int) -> list[list[Pass]]:
    """Every rank's forwards for an evaluation step (no backward)."""
    return list_orders(placement, micro_batches, Costs(), split=False)


def timeline(orders: list[list[Pass]], costs: Costs) -> list[list[tuple[str, int, int, float, float]]]:
    """[(kind, virtual stage, micro batch, start, end)] per rank: each pass as soon as its rank is free and
    its input has arrived (messages take no time). Raises if the orders deadlock."""
    stages = 1 + max(v for order in orders for _, v, _ in order)
    ranks = len(orders)
    position, clock, ends = [0] * ranks, [0.0] * ranks, {}
    passes: list[list[tuple[str, int, int, float, float]]] = [[] for _ in range(ranks)]
    while any(position[r] < len(orders[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while position[r] < len(orders[r]):
                kind, v, j = orders[r][position[r]]
                needs = dependency(kind, v, j, stages)
                if needs is not None and needs not in ends:
                    break
                start = max(clock[r], ends[needs] if needs is not None else 0.0)
                clock[r] = ends[(kind, v, j)] = start + costs.of(kind)
                passes[r].append((kind, v, j, start, clock[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("these orders deadlock: a pass waits for one that never runs")
    return passes


def schedule_costs(schedule: str, costs: Costs) -> Costs:
    """The costs `schedule`'s passes take: B is the whole backward where W is not split off."""
    return costs if schedule in SPLIT_BACKWARD else costs.unsplit()


def predicted_bubble(schedule: str, placement: Placement, micro_batches: int, costs: Costs = Costs()) -> float:
    """The mean over ranks of 1 − (the rank's work) / (the step) under `schedule`, `costs` per chunk."""
    played = schedule_costs(schedule, costs)
    passes = timeline(rank_orders(schedule, placement, micro_batches, costs), played)
    step = max(p[-1][4] for p in passes)
    work = placement.virtual * micro_batches * (costs.forward + costs.input_grad + costs.weight_grad)
    return 1.0 - work / step

