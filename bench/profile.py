"""Where a training step's time goes: a few steps of the real training loop under torch.profiler.

  python -m bench.profile model=gpt3-125m train.micro_batch_size=8 train.global_batch_size=8
  python -m bench.profile model=toy train.device=cpu model.n_layer=2 --steps 3     # on a CPU

The run is `train.run.loop.run` on the resolved config (train/run/spec.py), the loop `python -m train`
runs, for `--skip` + `--steps` + 1 steps (train.max_steps), without evaluation or sample and with one
checkpoint at the end, in a run folder of its own (--run-dir). The profiler follows the optimizer's
updates (a step hook): it is on from the end of update `--skip` (the first ones compile, autotune and
warm caches) to the end of the last, so neither the build nor the checkpoint is in it. It writes
the Chrome/Perfetto trace (open it in https://ui.perfetto.dev or chrome://tracing) as
<run dir>/profile_trace.json and prints, per step (ms, share):

  GEMM                    matrix multiplies (aten::mm/addmm/bmm, cuBLAS/CUTLASS kernels)
  attention forward       the attention kernel's forward (model/attention*.py, its op gpt3d::attention; SDPA's
                          flash/cuDNN kernels)
  attention backward      its backward
  communication           collectives (all-reduce, all-gather, send/recv: NCCL or gloo)
  optimizer               the update: AdamW (also DeepSpeed's bf16 optimizer around it), clipping
  other: NAME             every other op (CPU) or kernel (GPU), by name, the largest first
  idle                    GPU idle inside the step (no kernel running: launch overhead, host syncs)
                          on CUDA; on a CPU the step's time in no op (Python, the engine's bookkeeping)
  between steps           from the end of one step to the start of the next: data wait, logging, checks
  total                   the profiled steps' wall time, from the first one's start to the next step's

--json PATH also writes the table (rows in seconds per step, steps, total_s, device, trace, and the
command's overrides) as JSON: the summary to keep when the trace stays behind in a scratch folder.

A step spans from one `train_step` range (train/run/step.py marks each) to the next, so the rows add up
to the total by construction; on CUDA the op rows are device (kernel) time, on a CPU the ops' own
time on the training thread (each op's self time: nested ops are not counted twice).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

STEP_RANGE = "train_step"  # the record_function range train/run/step.py opens around each step
GEMM = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_addmm_activation)$|gemm|cutlass|cublas|xmma|wgmma|nvjet", re.I)
COMM = re.compile(r"nccl|gloo|c10d|all_reduce|allreduce|all_gather|allgather|reduce_scatter|broadcast|send|recv", re.I)
ATTENTION_KERNEL = re.compile(r"gpt3d::attention|_fwd_kernel|_bwd_kv|_bwd_q|_bwd_preprocess|flash|fmha|"
                              r"efficient_attention|cudnn.*attn", re.I)
OPTIMIZER = re.compile(r"Optimizer\.step|adam|multi_tensor_apply|clip_grad|_foreach_", re.I)
OTHER_ROWS = 8  # other ops listed by name; the rest are summed in one row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="the training config's overrides, as for python -m train")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps in the table (default 3)")
    parser.add_argument("--skip", type=int, default=1, help="steps run first, not profiled (default 1, at least 1)")
    parser.add_argument("--run-dir", type=Path, help="the run folder (default runs/profile/<time>)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the table to PATH as JSON")
    args = parser.parse_args()
    if args.steps < 1 or args.skip < 1:
        parser.error(f"--steps {args.steps} and --skip {args.skip} must be ≥ 1")
    run_dir = args.run_dir or Path("runs") / "profile" / time.strftime("%Y%m%d-%H%M%S")
    table = profile(args.overrides, run_dir, args.steps, args.skip)
    if table is not None:
        print(format_table(table))
        if args.json:
            from train.monitor.metrics import write_atomically

            write_atomically(args.json, json.dumps({**table, "overrides": args.overrides}, indent=1) + "\n")


def profile(overrides: list[str], run_dir: Path, steps: int, skip: int) -> dict | None:
    """Run the loop with the profiler on for the steps after the first `skip`; write the trace; the
    table ({"rows": {name: seconds per step}, ...}) on rank 0, None on other ranks."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from train.config.settings import ConfigError
    from train.run.loop import run
    from train.run.spec import resolve

    cfg = compose(overrides, skip + steps + 1)  # the step after the last profiled one closes its span
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        spec = resolve(cfg, run_dir, overrides)
    except ConfigError as err:
        raise SystemExit(f"bench.profile: {err}") from None
    cuda = torch.cuda.is_available() and spec.sections.train.device != "cpu"
    rank = int(os.environ.get("RANK", "0"))
    trace = run_dir / ("profile_trace.json" if rank == 0 else f"profile_trace.rank{rank}.json")

    def write(prof) -> None:
        partial = trace.with_name(trace.name + ".tmp")
        prof.export_chrome_trace(str(partial))
        partial.replace(trace)

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    # the profiler's steps follow the optimizer's: on from the end of update `skip` to the end of update
    # skip + steps + 1, so the trace holds the starts of steps skip + 1 … skip + steps + 1
    schedule = torch.profiler.schedule(wait=skip - 1, warmup=1, active=steps + 1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write) as prof:
        hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: prof.step())
        try:
            run(spec)
        finally:
            hook.remove()
    if rank != 0:
        return None
    table = breakdown(json.loads(trace.read_bytes().decode("utf-8", errors="replace"))["traceEvents"], cuda)
    table["trace"] = str(trace)
    return table


def compose(overrides: list[str], max_steps: int):
    """The training config with the command line's overrides, for a short run of max_steps steps."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_config

    register_config()
    quiet = [f"train.max_steps={max_steps}", "train.eval_interval=0", "train.sample_tokens=0",
             "train.checkpoint_interval=0", "logging.log_interval=1", "logging.wandb.mode=disabled"]
    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="profile"):
        return hydra_compose("config", overrides=[*quiet, *overrides])


def breakdown(events: list[dict], cuda: bool) -> dict:
    """{"rows": {name: seconds per step}, "steps": n, "total_s": wall time per step, "device"} from a
    Chrome trace's events (times in µs): step k spans from its `train_step` range's start to step k+1's."""
    spans_of = [e for e in events if e.get("ph") == "X" and e.get("name") == STEP_RANGE
                and e.get("cat") == "user_annotation"]
    marks = sorted((e["ts"], e["ts"] + e["dur"], e["tid"]) for e in spans_of)
    if len(marks) < 2:
        raise RuntimeError(f"the profile holds {len(marks)} training steps; it needs 2 at least")
    spans = [(a[0], b[0], a[1]) for a, b in zip(marks, marks[1:])]  # (start, next start, end)
    inside = sum(end - first for first, _, end in spans)
    total = sum(nxt - first for first, nxt, _ in spans)
    rows: dict[str, float] = defaultdict(float)
    if cuda:
        kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
        regions = [e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation"]
        for kernel in kernels:
            lineage = [r["name"] for r in regions if r["ts"] <= kernel["ts"] < r["ts"] + r["dur"]]
            for first, _, end in spans:
                rows[category(kernel["name"], lineage)] += _overlap(kernel, first, end)
        busy = _covered(kernels, spans)
        rows["GPU idle"] = max(inside - busy, 0.0)
    else:
        ops = [e for e in events if e.get("ph") == "X" and e.get("tid") == marks[0][2]
               and e.get("cat") in ("cpu_op", "user_annotation") and e.get("name") != STEP_RANGE
               and not e.get("name", "").startswith("ProfilerStep#")]  # the profiler's own step ranges
        busy = 0.0
        for op, own, lineage in _self_times(ops):
            for first, _, end in spans:
                share = own * _overlap(op, first, end) / max(op["dur"], 1e-9)
                rows[category(op["name"], lineage)] += share
                busy += share
        rows["idle: in no op"] = max(inside - busy, 0.0)
    rows["between steps: data wait, logging, checks"] = total - inside
    n = len(spans)
    return {"rows": {k: v / n / 1e6 for k, v in _folded(rows).items()}, "steps": n, "total_s": total / n / 1e6,
            "device": "cuda" if cuda else "cpu"}


def category(name: str, lineage: list[str]) -> str:
    """The table row of one op or kernel, by its name and the names of the ranges around it."""
    if COMM.search(name) or any(COMM.search(a) for a in lineage):
        return "communication"
    if OPTIMIZER.search(name) or any(OPTIMIZER.search(a) for a in lineage):
        return "optimizer"
    if any(ATTENTION_KERNEL.search(a) or "Attention" in a for a in [name, *lineage]):
        backward = re.search(r"bwd|backward", name, re.I) or any("Backward" in a for a in lineage)
        return "attention backward" if backward else "attention forward"
    if GEMM.search(name):
        return "GEMM"
    return f"other: {name}"


def _self_times(ops: list[dict]):
    """(op, its self time in µs, the names of the ops around it) for ops of one thread, nested by time."""
    ordered = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    own = [e["dur"] for e in ordered]
    stack: list[int] = []
    lineages = []
    for i, op in enumerate(ordered):
        while stack and ordered[stack[-1]]["ts"] + ordered[stack[-1]]["dur"] <= op["ts"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= op["dur"]
        lineages.append([ordered[j]["name"] for j in stack])
        stack.append(i)
    return [(op, max(t, 0.0), lineage) for op, t, lineage in zip(ordered, own, lineages)]


def _overlap(event: dict, first: float, end: float) -> float:
    return max(min(event["ts"] + event["dur"], end) - max(event["ts"], first), 0.0)


def _covered(kernels: list[dict], spans) -> float:
    """Time (µs) inside the steps during which at least one GPU kernel runs (streams may overlap)."""
    covered = 0.0
    intervals = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    for first, _, last in spans:
        edge = first
        for start, end in intervals:
            start, end = max(start, edge), min(end, last)
            if end > start:
                covered += end - start
                edge = end
    return covered


def _folded(rows: dict[str, float]) -> dict[str, float]:
    """The fixed rows, then the OTHER_ROWS largest other ones by name, the rest in one row."""
    others = sorted(((k, v) for k, v in rows.items() if k.startswith("other: ")), key=lambda kv: -kv[1])
    fixed = {k: v for k, v in rows.items() if not k.startswith("other: ")}
    folded = {k: fixed.pop(k, 0.0) for k in ("GEMM", "attention forward", "attention backward", "communication",
                                             "optimizer")}
    folded.update(others[:OTHER_ROWS])
    folded[f"other: the rest ({max(len(others) - OTHER_ROWS, 0)} names)"] = sum(v for _, v in others[OTHER_ROWS:])
    folded.update(fixed)  # idle, between steps
    return folded


def format_table(table: dict) -> str:
    total = table["total_s"]
    what = "kernel time" if table["device"] == "cuda" else "op self time on the training thread"
    lines = [f"where a step's time goes: {table['steps']} steps, {1e3 * total:.1f} ms per step ({what}); "
             f"trace {table['trace']}", f"{'row':<52} {'ms/step':>9} {'share':>7}", "-" * 70]
    for name, seconds in table["rows"].items():
        lines.append(f"{name[:52]:<52} {1e3 * seconds:>9.2f} {seconds / total:>7.1%}")
    lines.append(f"{'total':<52} {1e3 * total:>9.2f} {1:>7.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
