"""Pipeline bubble benchmark: DeepSpeed's 1F1B and gpt3d's ZB-H1, interleaved (V=2) and ZB-V schedules, each
measured against its prediction.

  python -m bench.pipeline_bubble                          # pp ∈ {2, 4} × m ∈ {4, 8}, every schedule, 5 steps
  python -m bench.pipeline_bubble --quick                  # pp ∈ {2, 4} × m = 4, 2 steps, 20 ms passes: a smoke run
  python -m bench.pipeline_bubble --t-forward 20 --t-backward 20 --t-weight 20   # shorter stage work
  python -m bench.pipeline_bubble --pp 4 --m 8 --timeline  # one case, and where each stage's step goes
  python -m bench.pipeline_bubble --results bench/results  # also pipeline_bubble-CPU-<date>.{json,md} there

A stage's backward splits into B (its input gradient, which the previous stage waits for) and W (its
weight gradients, which only the optimizer step needs). With pp equal ranks whose forward, B and W take
t_F, t_B and t_W for a micro batch, m micro batches per step and free communication (parallel/schedules/):

    1F1B          step = (m + pp − 1)·(t_F + t_B + t_W)                 bubble (pp − 1)/(m + pp − 1)
    ZB-H1         step = m·(t_F + t_B + t_W) + (pp − 1)·(t_F + t_B − t_W)
    interleaved   step = (V·m + pp − 1)·(t_F + t_B + t_W)/V             V = 2 chunks a rank, each half the work
    ZB-V          its list schedule's step (2 chunks a rank in a V, each half the work)

and the predicted bubble is the mean over ranks of 1 − (a rank's work, m·(t_F + t_B + t_W)) / step:
parallel.schedules.orders.predicted_bubble with the same costs (t_F = t_B = t_W at pp = 4, m = 8: 1F1B
3/11 = 0.273, ZB-H1 3/27 = 0.111, interleaved 3/19 = 0.158, ZB-V 3/51 = 0.059).

Method. For each pp, pp forked CPU processes (gloo) run a deepspeed.pipe.PipelineModule of identical
sleeping stages (`SleepChunks`: one per virtual stage, placed as the schedule places them) through
deepspeed.initialize → PipelineEngine.train_batch, once per m and schedule (gradient_accumulation_steps =
m), the schedules of a case back to back in the same process group. A stage's work is a wait, not
compute: its forward sleeps t_F/V. Under 1F1B (DeepSpeed's TrainSchedule) and the interleaved schedule its
backward sleeps (t_B + t_W)/V at once, the whole backward. gpt3d's schedules run on ScheduleEngine.adopt;
under ZB-H1 and ZB-V the backward sleeps t_B/V, returns the input gradient and defers W to the rank's
WeightGradStore (store.defer) as a function that sleeps t_W/V and returns the gradient of the stage's
scalar parameter, which the engine's W pass accumulates. A sleeping process leaves the CPU free, so the
ranks overlap as they would on pp devices even on a 2-core machine. Each rank adds up the time its
stages spend in their sleeps (F, B and W: busy) and times train_batch after a barrier (step), so

    measured bubble of a stage = 1 − busy / step,

the median over the measured steps (after one warm-up step; a shared machine's stalls hit single steps),
averaged over the stages. It counts everything that is not the stages' own work: the engine's schedule
and Python, p2p sends and receives (gloo over loopback) and the wake-ups they need, the gradient
reductions, the optimizer step and the loss broadcast at the end of train_batch. These cost a roughly
fixed time per step (about 35 ms at pp = 4 on a busy 2-core machine, more for more hand-offs), which
weighs more against ZB-H1's shorter step than against 1F1B's. The stage work (--t-forward, --t-backward,
--t-weight) is 100 ms a pass by default, equal costs as in the issue, so that this overhead, which a GPU
run overlaps with its kernels, stays a few percent of a step (at 20 ms passes it is a quarter of ZB-H1's
bubble at pp = 4, m = 8; --quick runs at 20 ms).

Columns: predicted and measured bubbles, `worst stage` (the highest rank's bubble), `ratio` = measured /
predicted, `step ms` (median step, mean over ranks), `ideal ms` (the predicted step: the ranks' work /
(1 − predicted)), and for gpt3d's schedules `vs 1f1b` = its measured bubble / 1F1B's in the same run.
--timeline adds, per stage (means over the steps): the time before its first pass, the gaps between its
passes and the time after its last one (tail: gradient reductions, optimizer step, loss broadcast), each
beside the predicted timeline's, and how much its sleeps overran (counted as busy). --results DIR writes
the rows as pipeline_bubble-CPU-<date>.json (one object per row, every stage's bubble at every step
included) and the printed output, with the command, commit, date and versions, as
pipeline_bubble-CPU-<date>.md; a run with other costs adds them to the name (-F20-B20-W20), a --quick
run adds -quick.
"""

from __future__ import annotations

import argparse
import datetime
import io
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.attention import git_commit

SHAPE = (1, 8, 16)  # one micro batch of activations: (micro batch, tokens, hidden)
DEFAULT_PASS_MS = 100.0  # F, B and W each: the per-step overhead (about 35 ms here) stays a few % of a step
SCHEDULES = ("1f1b", "zb-h1", "interleaved", "zb-v")
CHUNKS = 2  # the interleaved schedule's V here
DEVICE = "CPU (gloo, sleeping stages)"


class _SleepScale(torch.autograd.Function):
    """y = x · scale. Forward sleeps t_F; backward sleeps t_B + t_W (1F1B) or t_B with W deferred (ZB-H1)."""

    @staticmethod
    def forward(ctx, x, scale, stage):
        ctx.stage = stage
        ctx.save_for_backward(x, scale)
        stage.wait("F", stage.t_f)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        stage = ctx.stage
        x, scale = ctx.saved_tensors
        if stage.store is None:  # the whole backward at once
            stage.wait("BW", stage.t_b + stage.t_w)
            return grad * scale, (grad * x).sum().reshape(1), None
        stage.wait("B", stage.t_b)

        stage.store.defer(scale, None, _weight_grad, stage, grad, x)
        return grad * scale, None, None


def _weight_grad(stage, grad, x):
    """A deferred W: sleeps t_W, returns the stage's scalar weight's gradient."""
    stage.wait("W", stage.t_w)
    return (grad * x).sum().reshape(1), None


class SleepStage(torch.nn.Module):
    """One pipeline stage: a scalar weight (so the optimizer has a parameter) and timed waits."""

    def __init__(self, t_f: float, t_b: float, t_w: float, store=None):
        super().__init__()
        self.t_f, self.t_b, self.t_w, self.store = t_f, t_b, t_w, store
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.busy, self.passes = 0.0, []

    def wait(self, kind: str, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        end = time.perf_counter()
        self.busy += end - start
        self.passes.append((kind, start, end))

    def forward(self, x):
        return _SleepScale.apply(x, self.scale, self)


def mse(outputs, labels):
    return ((outputs - labels) ** 2).mean()


def sleep_chunks(placement, t_f: float, t_b: float, t_w: float, store=None):
    """A PipelineModule of placement.stages SleepStages (each t_F/V, t_B/V, t_W/V), this rank building its own
    virtual stages, a forward running chunk `chunk` (as parallel/pipeline.PipelineStages does for the model)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    chunks = placement.virtual

    class SleepChunks(PipelineModule):
        def __init__(self):
            self.placement, self.chunk = placement, 0  # plain attributes, read while Module.__init__ builds
            super().__init__(layers=[LayerSpec(SleepStage, t_f / chunks, t_b / chunks, t_w / chunks, store)
                                     for _ in range(placement.stages)],
                             num_stages=placement.pp, loss_fn=mse, partition_method="uniform")

        def _partition_layers(self, method="uniform"):
            own = placement.stages_of(self.stage_id)
            self.parts = list(range(placement.stages + 1))
            self._set_bounds(start=own[0], stop=own[-1] + 1)

        def _build(self):
            for v in placement.stages_of(self.stage_id):
                layer = self._layer_specs[v].build()
                self.forward_funcs.append(layer)
                self.add_module(str(v), layer)

        def forward(self, x):
            return self.forward_funcs[self.chunk](x)

    return SleepChunks()


def measure(schedule: str, pp: int, m: int, t_f: float, t_b: float, t_w: float, steps: int) -> list[dict]:
    """This rank's {busy, step, passes} in each of `steps` train_batch calls, after one warm-up."""
    import deepspeed

    from model.weight_grads import WeightGradStore
    from parallel.schedules.engine import ScheduleEngine
    from parallel.schedules.orders import SPLIT_BACKWARD, placement_of

    store = WeightGradStore() if schedule in SPLIT_BACKWARD else None
    placement = placement_of(schedule, pp, CHUNKS)
    module = sleep_chunks(placement, t_f, t_b, t_w, store)
    config = {
        "train_batch_size": m * SHAPE[0],
        "train_micro_batch_size_per_gpu": SHAPE[0],
        "gradient_accumulation_steps": m,
        "steps_per_print": 10**9,
        "timers": {"throughput": {"enabled": False}},  # as training runs it (train/run/engine.py)
    }
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    if schedule != "1f1b":  # equal passes: the order the engine builds on the CPU (RunSpec.pass_costs)
        engine = ScheduleEngine.adopt(engine, schedule, placement.virtual, store)
    stages = [layer for layer in module.modules() if isinstance(layer, SleepStage)]
    data = itertools.repeat((torch.randn(SHAPE), torch.randn(SHAPE)))
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        for stage in stages:
            stage.busy, stage.passes = 0.0, []
        start = time.perf_counter()
        engine.train_batch(data)
        step = time.perf_counter() - start
        passes = sorted((a - start, b - start, kind) for stage in stages for kind, a, b in stage.passes)
        times.append({"busy": sum(stage.busy for stage in stages), "step": step,
                      "passes": [(kind, a, b) for a, b, kind in passes]})
    return times[1:]


def run_stages(measure_case, pp: int, cases: list[tuple[int, str]], prepare=None) -> dict:
    """{(m, schedule): [measure_case(schedule, m) of each stage]} for each case, from pp ranks forked here in
    one gloo group (DeepSpeed's), each with one thread; `prepare` runs on every rank before the first case.
    Both benchmarks of the pipeline (this one and bench.pipeline_memory) measure through it."""
    results = mp.get_context("fork").SimpleQueue()
    args = (pp, _free_port(), cases, measure_case, prepare, results)
    ranks = mp.start_processes(_stage_main, args=args, nprocs=pp, start_method="fork", join=False)
    # read as the ranks write: a case's records can outgrow the pipe's buffer (pp=4, m=8: its passes), and rank 0
    # would block in put while the others wait for it in the next case, if the results were read only at the end
    measured, ended = {}, False
    while len(measured) < len(cases):
        if not results.empty():
            key, records = results.get()
            measured[key] = records
        elif ended:
            raise RuntimeError(f"the {pp} ranks ended with {len(measured)} of {len(cases)} cases measured")
        else:
            ended = ranks.join(timeout=0.1)  # True once every rank has ended; a rank's exception is raised here
    while not ranks.join():
        pass
    return measured


def _stage_main(rank, pp, port, cases, measure_case, prepare, results):
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # DeepSpeed's banners; results go through `results`
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(pp), LOCAL_WORLD_SIZE=str(pp),
    )
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    if prepare is not None:
        prepare()
    for m, schedule in cases:
        gathered = [None] * pp
        dist.all_gather_object(gathered, measure_case(schedule, m))
        if rank == 0:
            results.put(((m, schedule), gathered))
    dist.barrier()
    dist.destroy_process_group()


def run(pp: int, cases: list[tuple[int, str]], costs: tuple[float, float, float], steps: int) -> dict:
    """{(m, schedule): [[{busy, step, passes} for each step] for each stage]} from pp forked ranks."""
    return run_stages(lambda schedule, m: measure(schedule, pp, m, *costs, steps), pp, cases)


def _import_before_fork() -> None:
    """Import DeepSpeed, and torch._dynamo (which torch.optim imports on first use), once, here:
    the forked ranks inherit them instead of each spending seconds (tens, on a busy 2-core
    machine) importing its own."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed.pipe  # noqa: F401
    import torch._dynamo  # noqa: F401
    from deepspeed.utils import logger

    import parallel.schedules.engine  # noqa: F401
    from parallel.topology import skip_shared_memory_op

    logger.setLevel("WARNING")
    skip_shared_memory_op()  # as a training run does: no C++ build at start-up


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def summarize(schedule: str, pp: int, m: int, per_stage: list[list[dict]], costs) -> dict:
    """One row: the predicted and measured bubbles of a case and its step time, medians over the steps."""
    from parallel.schedules.orders import Costs, placement_of, predicted_bubble

    steps = len(per_stage[0])
    step_bubbles = [[1 - t["busy"] / t["step"] for t in times] for times in per_stage]  # [stage][step]
    stage_bubbles = [statistics.median(bubbles) for bubbles in step_bubbles]
    placement = placement_of(schedule, pp, CHUNKS)
    chunks = placement.virtual
    predicted = predicted_bubble(schedule, placement, m, Costs(*(t / chunks for t in costs)))
    return {
        "schedule": schedule, "pp": pp, "m": m, "steps": steps,
        "t_forward_ms": costs[0] * 1e3, "t_input_grad_ms": costs[1] * 1e3, "t_weight_grad_ms": costs[2] * 1e3,
        "predicted": predicted, "measured": sum(stage_bubbles) / pp, "worst_stage": max(stage_bubbles),
        "stage_bubbles": stage_bubbles, "stage_step_bubbles": step_bubbles,
        "step_ms": statistics.median(sum(times[k]["step"] for times in per_stage) / pp for k in range(steps)) * 1e3,
        "ideal_ms": m * sum(costs) / (1 - predicted) * 1e3,
    }


def _orders(schedule: str, pp: int, m: int, costs):
    """Each rank's passes in the order the engine runs them, [(kind, virtual stage, micro batch)], and the
    predicted timeline [(kind, stage, micro batch, start, end)] (messages free, no overhead); a backward that
    is one pass (1F1B, interleaved) is "B" here. `costs` are a rank's, each chunk's its share."""
    from parallel.schedules.orders import Costs, placement_of, rank_orders, schedule_costs, timeline

    placement = placement_of(schedule, pp, CHUNKS)
    chunk = Costs(*(t / placement.virtual for t in (costs.forward, costs.input_grad, costs.weight_grad)))
    orders = rank_orders(schedule, placement, m)
    return orders, timeline(orders, schedule_costs(schedule, chunk)), placement


def critical_path(orders, step: dict, placement) -> tuple[list[float], list[float], float, float]:
    """The chain of passes that set one measured step's length, walked back from the pass that ended last:
    each pass started after either the previous pass on its rank (a gap on one rank: the engine's own work
    between two passes) or the pass on another rank it needed (a hand-off: the message and the wake-up),
    whichever ended later. Returns (hand-off gaps, same-rank gaps, time before the chain's first pass, time
    after its last pass), in seconds."""
    from parallel.schedules.orders import dependency

    pp, passes, rank_of = placement.pp, {}, {}
    for r, (order, measured) in enumerate(zip(orders, step)):
        for (kind, v, j), (_, start, end) in zip(order, measured["passes"]):
            passes[(kind, v, j)], rank_of[(kind, v, j)] = (start, end), r
    last = max(passes, key=lambda key: passes[key][1])
    tail = sum(t["step"] for t in step) / pp - passes[last][1]
    handoffs, local, current = [], [], last
    while True:
        start, r = passes[current][0], rank_of[current]
        index = orders[r].index(current)
        previous = orders[r][index - 1] if index else None
        needed = dependency(*current, placement.stages)
        if needed is not None and rank_of.get(needed) == r:
            needed = None  # on this rank: a same-rank gap
        previous_end = passes[previous][1] if previous else 0.0
        if needed is not None and passes[needed][1] > previous_end:
            handoffs.append(start - passes[needed][1])
            current = needed
        elif previous is not None:
            local.append(start - previous_end)
            current = previous
        else:
            return handoffs, local, start, tail


def timeline_lines(schedule: str, pp: int, m: int, per_stage: list[list[dict]], costs) -> list[str]:
    """Per stage, mean over steps: time before the first pass, gaps between passes, the tail after the last
    pass, and the same three of the predicted timeline; then the steps' critical path (`critical_path`)."""
    from parallel.schedules.orders import Costs

    c = Costs(*costs)
    orders, predicted, placement = _orders(schedule, pp, m, c)
    end = max(p[-1][4] for p in predicted)
    v = placement.virtual
    nominal = {"F": c.forward / v, "B": c.input_grad / v, "W": c.weight_grad / v, "BW": (c.input_grad + c.weight_grad) / v}
    lines = []
    for s, times in enumerate(per_stage):
        n = len(times)
        overrun = sum(b - a - nominal[kind] for t in times for kind, a, b in t["passes"]) / n
        head = sum(t["passes"][0][1] for t in times) / n
        gaps = sum(sum(b[1] - a[2] for a, b in zip(t["passes"], t["passes"][1:])) for t in times) / n
        tail = sum(t["step"] - t["passes"][-1][2] for t in times) / n
        p = predicted[s]
        p_head, p_gaps, p_tail = p[0][3], sum(b[3] - a[4] for a, b in zip(p, p[1:])), end - p[-1][4]
        lines.append(f"    rank {s}: before first pass {head * 1e3:6.1f} ms (predicted {p_head * 1e3:6.1f}), "
                     f"gaps {gaps * 1e3:6.1f} ({p_gaps * 1e3:6.1f}), after last pass {tail * 1e3:6.1f} "
                     f"({p_tail * 1e3:6.1f}); {len(times[0]['passes'])} passes, their sleeps overran by "
                     f"{overrun * 1e3:.1f} ms in all")
    paths = [critical_path(orders, [times[k] for times in per_stage], placement) for k in range(len(per_stage[0]))]
    n = len(paths)
    handoffs = sum(len(h) for h, _, _, _ in paths) / n
    local = sum(len(g) for _, g, _, _ in paths) / n
    lines.append(f"    critical path (mean over steps): {handoffs:.1f} hand-offs between ranks of "
                 f"{sum(sum(h) for h, _, _, _ in paths) / max(1, sum(len(h) for h, _, _, _ in paths)) * 1e3:.2f} ms "
                 f"each, {local:.1f} gaps between passes on one stage of "
                 f"{sum(sum(g) for _, g, _, _ in paths) / max(1, sum(len(g) for _, g, _, _ in paths)) * 1e3:.2f} ms each, "
                 f"{sum(h for _, _, h, _ in paths) / n * 1e3:.1f} ms before its first pass, "
                 f"{sum(t for _, _, _, t in paths) / n * 1e3:.1f} ms after its last")
    return lines


def header(costs_ms, steps: int) -> list[str]:
    t_f, t_b, t_w = costs_ms
    return [
        f"pipeline bubble on CPU (gloo, sleeping stages): F {t_f:g} ms, B {t_b:g} ms, W {t_w:g} ms "
        f"a rank's micro batch (1F1B's backward B+W {t_b + t_w:g} ms; interleaved V={CHUNKS} and zb-v: each chunk "
        f"1/2 of it); {steps} steps after a warm-up; measured = 1 − rank busy / step (median over steps, mean over "
        f"ranks)",
        f"{'schedule':<11} {'pp':>3} {'m':>3} {'predicted':>10} {'measured':>9} {'worst stage':>12} {'ratio':>6} "
        f"{'step ms':>8} {'ideal ms':>9} {'vs 1f1b':>8}",
    ]


def row_line(row: dict, vs_1f1b: float | None) -> str:
    ratio = f"{vs_1f1b:>8.2f}" if vs_1f1b is not None else f"{'':>8}"
    return (f"{row['schedule']:<11} {row['pp']:>3} {row['m']:>3} {row['predicted']:>10.3f} {row['measured']:>9.3f} "
            f"{row['worst_stage']:>12.3f} {row['measured'] / row['predicted']:>6.2f} {row['step_ms']:>8.1f} "
            f"{row['ideal_ms']:>9.1f} {ratio}")


class Transcript:
    """What a benchmark prints, line by line as it comes, and kept for its results' markdown."""

    def __init__(self):
        self._lines = io.StringIO()

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self._lines.write(line + "\n")

    def text(self) -> str:
        return self._lines.getvalue()


def write_results(folder: Path, suffix: str, rows: list[dict], printed: str, command: str, seconds: float,
                  stem: str = "pipeline_bubble", title: str = "Pipeline bubble", device: str = DEVICE) -> list[Path]:
    """<stem>-CPU-<date><suffix>.json (one object per row, with device, date, commit and command) and .md
    (`title`, the command, commit, versions and the printed output) in `folder`."""
    import deepspeed

    now = datetime.datetime.now(datetime.timezone.utc)
    date, commit = now.isoformat(timespec="seconds"), git_commit()
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{stem}-CPU-{now.date().isoformat()}{suffix}"
    records = [{**row, "device": device, "date": date, "commit": commit, "command": command} for row in rows]
    json_path, md_path = folder / f"{name}.json", folder / f"{name}.md"
    json_path.write_text(json.dumps(records, indent=1) + "\n")
    versions = f"python {platform.python_version()} | torch {torch.__version__} | deepspeed {deepspeed.__version__}"
    md_path.write_text(
        f"# {title} on {device}, {now:%Y-%m-%d %H:%M} UTC\n\n"
        f"Command: `{command}` at commit {commit[:7] if commit else 'unknown'}, {seconds:.0f} s\n\n"
        f"{versions}; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end\n\n"
        f"```\n{printed.rstrip()}\n```\n")
    return [json_path, md_path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m = 4 only and 2 steps: a smoke run")
    parser.add_argument("--t-forward", type=float, help="a stage's forward F, ms (default 100; --quick 20)")
    parser.add_argument("--t-backward", type=float, help="a stage's input-gradient pass B, ms (default 100; --quick 20)")
    parser.add_argument("--t-weight", type=float, help="a stage's weight-gradient pass W, ms (default 100; --quick 20)")
    parser.add_argument("--steps", type=int, help="measured steps per case, after one warm-up (default 5; --quick 2)")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline depths (default 2 4)")
    parser.add_argument("--m", type=int, nargs="+", help="micro batches per step (default 4 8; --quick 4)")
    parser.add_argument("--timeline", action="store_true", help="also where each stage's step goes (see above)")
    parser.add_argument("--results", metavar="DIR", type=Path,
                        help="also write pipeline_bubble-CPU-<date>.json and .md into DIR (e.g. bench/results)")
    args = parser.parse_args()
    ms = args.m or ([4] if args.quick else [4, 8])
    steps = args.steps or (2 if args.quick else 5)
    default_ms = 20.0 if args.quick else DEFAULT_PASS_MS
    costs_ms = tuple(default_ms if t is None else t for t in (args.t_forward, args.t_backward, args.t_weight))
    costs = tuple(t / 1e3 for t in costs_ms)
    started = time.perf_counter()
    _import_before_fork()

    say = Transcript()

    for line in header(costs_ms, steps):
        say(line)
    rows = []
    for pp in args.pp:
        cases = [(m, schedule) for m in ms for schedule in SCHEDULES]
        measured = run(pp, cases, costs, steps)
        for m in ms:
            baseline = None
            for schedule in SCHEDULES:
                row = summarize(schedule, pp, m, measured[(m, schedule)], costs)
                vs = row["measured"] / baseline["measured"] if baseline is not None else None
                row["vs_1f1b"] = vs
                rows.append(row)
                say(row_line(row, vs))
                if args.timeline:
                    for line in timeline_lines(schedule, pp, m, measured[(m, schedule)], costs):
                        say(line)
                baseline = baseline or row
    if args.results:
        command = " ".join(["python -m bench.pipeline_bubble", *sys.argv[1:]])
        # the default run as pipeline_bubble-CPU-<date>; others named by their costs, and quick runs as such
        suffix = "" if costs_ms == (default_ms,) * 3 else "-F{:g}-B{:g}-W{:g}".format(*costs_ms)
        suffix += "-quick" if args.quick else ""
        for path in write_results(args.results, suffix, rows, say.text(), command, time.perf_counter() - started):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
