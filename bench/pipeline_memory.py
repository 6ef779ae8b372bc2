"""Pipeline activation memory: gpt3d's ZB-H1 schedule against DeepSpeed's 1F1B, stage by stage, on the CPU.

  python -m bench.pipeline_memory                          # pp=4 m=8 and pp=2 m=4, 8 blocks of d_model 128, T 256
  python -m bench.pipeline_memory --quick                  # pp=2 m=4, 4 blocks, T 128: a smoke run (about 5 s)
  python -m bench.pipeline_memory --micro-batch 2          # more activation per micro batch
  python -m bench.pipeline_memory --results bench/results  # also pipeline_memory-CPU-<date>.{json,md} there
                                                           # (other runs' names add -mb2, -quick)

ZB-H1 (parallel/schedules/) defers each micro batch's weight gradients (W) past its input-gradient pass
(B), and a deferred W keeps its linears' inputs and output gradients alive until it runs. Stage s holds at
most pp − s micro batches' activations and s + 1 deferred W passes, at most pp micro batches in flight as
stage 0 does under 1F1B, so the claim (Qi et al. 2023) is that the peak over stages stays 1F1B's, while a
later stage may hold more than it did under 1F1B.

Method. pp forked CPU processes (gloo), one pipeline stage each, build the real model (parallel.build.build_model
with a Topology.create(tp=1, pp) layout; BuildOptions(weight_grads=WeightGradStore()) for ZB-H1, None for 1F1B)
in fp32 and train it through deepspeed.initialize with the DeepSpeed config and optimizer train/run/loop.py would
use (train.run.engine.deepspeed_config and create_engine, train.run.optimizer.make_optimizer), the ZB-H1 engine adopted
with ScheduleEngine.adopt. For each schedule: one warm-up train_batch, then the same batch (m micro batches
of `micro batch` sequences) again, both under torch.profiler with profile_memory=True. The profiler records
every allocation and release of a CPU tensor's storage by c10's allocator ([memory] events: the exact bytes
asked for, + or −, in order; it sees no Python objects and no allocator overhead), so their running sum is
the live tensor memory relative to any point, here the measured step's start. It reports no release of a
block allocated before it started, hence the profile begins before the warm-up step, and garbage in
reference cycles is collected before the measured step (so that no collection of older garbage lowers the
count during it). As a check, every stage's live memory must be back at the step's start when the
gradient reductions (ReduceTiedGrads) begin: all the passes allocated, released (the last line of a case
gives the largest difference over stages, 0 to a few bytes). The gradients are made (zeros) before the
measured step, as persistent buffers would be, so that the peak is activation memory and not the stage's
gradients: everything the passes allocate and hold at once (saved activations, the tensors a deferred W
keeps and the weight gradients it computes, pipeline buffers, posted receives, sent tensors not yet received).

Printed per case and stage, for both schedules: the peak over the passes (MiB above the step's start)
and the pipeline instruction it falls in (each instruction runs under a profiler range named after it
and its micro batch; the instructions themselves are unchanged), `zb/1f1b` = ZB-H1's / 1F1B's; then the
maximum over stages of each, whose ratio is the claim's test. The step's end, the gradient reductions
and the optimizer step, is left out: it holds no activations, and DeepSpeed's gradient all-reduce
flattens the stage's gradients into a buffer whose release gloo's thread sometimes performs, where the
profiler does not see it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.pipeline_bubble import Transcript, run_stages, write_results
from model import GPTConfig

SCHEDULES = ("1f1b", "zb-h1")
DEVICE = "CPU (gloo)"
MIB = 2**20


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's own log lines (kineto's start and stop, c10's note on blocks allocated before it started)
    go to /dev/null; errors still surface as the rank's exception."""
    saved = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _annotate_instructions() -> None:
    """Run each pipeline instruction (DeepSpeed's and the ZB-H1 engine's) under a torch.profiler range named
    after it and its micro batch, so that the profile says in which instruction a stage's peak falls. Only
    the names the profiler sees change: each instruction runs as before (in this forked rank alone)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from parallel.schedules.engine import ScheduleEngine

    def annotated(kind, run):
        def instruction(self, **kwargs):
            buffer = f"({kwargs['buffer_id']})" if "buffer_id" in kwargs else ""
            with torch.profiler.record_function(kind.__name__ + buffer):
                return run(self, **kwargs)
        return instruction

    for table in (PipelineEngine._INSTRUCTION_MAP, ScheduleEngine._INSTRUCTIONS):
        for kind, run in list(table.items()):
            table[kind] = annotated(kind, run)


def activation_peaks(prof) -> dict:
    """From a profile of a warm-up train_batch and a measured one (a "measured step" range): the live CPU
    tensor bytes above the measured step's start at its peak over the passes (up to the step's gradient
    reductions, ReduceTiedGrads), the instruction the peak falls in, and the bytes still live then."""
    events = prof.profiler.kineto_results.events()
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    if not memory:
        raise RuntimeError("torch.profiler recorded no [memory] events: cannot measure memory on this torch")
    (step,) = [e for e in events if e.name() == "measured step"]
    (reductions,) = [e for e in events if e.name() == "ReduceTiedGrads" and e.start_ns() >= step.start_ns()]
    ranges = [e for e in events if e.is_user_annotation() and step.start_ns() <= e.start_ns() < reductions.start_ns()
              and e.name() != "measured step"]

    def where(t: int) -> str:
        inside = [e for e in ranges if e.start_ns() <= t <= e.end_ns()]
        return min(inside, key=lambda e: e.duration_ns()).name() if inside else "-"

    live = peak = 0
    peak_at = step.start_ns()
    for event in memory:
        if step.start_ns() <= event.start_ns() < reductions.start_ns():
            live += event.nbytes()
            if live > peak:
                peak, peak_at = live, event.start_ns()
    return {"peak_bytes": peak, "peak_at": where(peak_at), "passes_end_bytes": live}


def measure(schedule: str, config: GPTConfig, pp: int, m: int, micro_batch: int, seed: int) -> dict:
    """This rank's activation memory in one train_batch of `schedule`, after a warm-up step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from model.weight_grads import WeightGradStore
    from parallel.build import BuildOptions, build_model
    from parallel.topology import Topology
    from parallel.schedules.engine import ScheduleEngine
    from train.config.sections import ParallelConfig, TrainConfig
    from train.config.sections.optim import OptimConfig
    from train.run.engine import clipping, create_engine, deepspeed_config
    from train.run.optimizer import make_optimizer
    from train.run.step import micro_batch_split, pipeline_inputs
    from train.runtime.resolve import Runtime

    device = torch.device("cpu")
    topology = Topology.create(tp=1, pp=pp)
    store = WeightGradStore() if schedule == "zb-h1" else None
    torch.manual_seed(seed)
    model = build_model(config, topology, seed, device, BuildOptions(weight_grads=store))
    train = TrainConfig(global_batch_size=m * micro_batch, micro_batch_size=micro_batch, precision="fp32", device="cpu")
    parallel, optim = ParallelConfig(pp=pp, pipeline_schedule=schedule), OptimConfig()
    fp32 = Runtime(device, "fp32")
    optimizer = make_optimizer(model, optim, 1e-4, clip=clipping(parallel, fp32), mpu=model.mpu())
    engine = create_engine(model, optimizer, None, deepspeed_config(train, parallel, optim, {}, 1, fp32))
    if store is not None:
        engine = ScheduleEngine.adopt(engine, schedule, 1, store)
    windows = torch.randint(0, config.vocab_size, (m * micro_batch, config.seq_len + 1),
                            generator=torch.Generator().manual_seed(seed))
    batches = micro_batch_split(windows, micro_batch)
    params = [p for p in model.parameters() if p.requires_grad]
    # Profiled from before the warm-up step: the profiler reports no release of a block allocated before it
    # started, so every tensor the measured step may release (the warm-up's leftovers, the optimizer's
    # state) is allocated inside the profile.
    # Garbage in reference cycles (the previous case's engine, the warm-up's leftovers) is collected before the
    # measured step, so that no collection of older garbage during the step lowers the count.
    gc.collect()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.train_batch(data_iter=pipeline_inputs(batches))  # warm-up: shapes exchanged, optimizer state made
        with record_function("gradient buffers"):
            for p in params:  # the gradients as persistent buffers (DeepSpeed frees them after each step): not
                if p.grad is None:  # activations, the same under both schedules, so in the step's starting memory
                    p.grad = torch.zeros_like(p)
        gc.collect()
        dist.barrier()
        with record_function("measured step"):
            engine.train_batch(data_iter=pipeline_inputs(batches))
        gc.collect()  # what the step left in reference cycles, released inside the profile (the end check)
    return {"schedule": schedule, "stage": topology.pp_rank, **activation_peaks(prof),
            "param_bytes": sum(p.numel() * p.element_size() for p in params)}


def run(pp: int, cases: list[tuple[int, str]], config: GPTConfig, micro_batch: int, seed: int) -> dict:
    """{(m, schedule): [this stage's measure() for each stage]} from pp forked ranks."""
    return run_stages(lambda schedule, m: measure(schedule, config, pp, m, micro_batch, seed), pp, cases,
                      prepare=_annotate_instructions)


def _import_before_fork() -> None:
    """Import DeepSpeed, torch._dynamo and gpt3d's pipeline once, here: the forked ranks inherit them."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed.pipe  # noqa: F401
    import torch._dynamo  # noqa: F401
    from deepspeed.utils import logger

    import parallel.build  # noqa: F401
    import parallel.schedules.engine  # noqa: F401
    import train.run.optimizer  # noqa: F401
    import train.run.step  # noqa: F401
    from parallel.topology import skip_shared_memory_op

    logger.setLevel("WARNING")
    skip_shared_memory_op()


def case_lines(pp: int, m: int, by_schedule: dict[str, list[dict]]) -> tuple[list[str], dict]:
    """The printed lines of one (pp, m) case and its JSON record."""
    one, zb = (sorted(by_schedule[s], key=lambda r: r["stage"]) for s in SCHEDULES)
    lines = [f"pp={pp} m={m}",
             f"  {'stage':>5} {'1f1b MiB':>9} {'1f1b peak in':<17} {'zb-h1 MiB':>10} {'zb-h1 peak in':<17} {'zb/1f1b':>8}"]
    for a, b in zip(one, zb):
        lines.append(f"  {a['stage']:>5} {a['peak_bytes'] / MIB:>9.2f} {a['peak_at']:<17} {b['peak_bytes'] / MIB:>10.2f} "
                     f"{b['peak_at']:<17} {b['peak_bytes'] / a['peak_bytes']:>8.3f}")
    max_one, max_zb = max(r["peak_bytes"] for r in one), max(r["peak_bytes"] for r in zb)
    lines.append(f"  {'max':>5} {max_one / MIB:>9.2f} {'':<17} {max_zb / MIB:>10.2f} {'':<17} {max_zb / max_one:>8.3f}")
    off = max(abs(r["passes_end_bytes"]) for r in one + zb)
    lines.append("  gradients, zeros made before the step (DeepSpeed frees them after each step): "
                 + ", ".join(f"{r['param_bytes'] / MIB:.2f}" for r in one) + " MiB by stage; "
                 f"live memory back at the step's start when the gradient reductions begin, on every stage: "
                 f"to within {off} bytes")
    record = {"pp": pp, "m": m,
              "stages": [{"stage": a["stage"], **{f"{s}_{key}": r[key] for s, r in zip(SCHEDULES, (a, b))
                                                  for key in ("peak_bytes", "peak_at", "passes_end_bytes")},
                          "ratio": b["peak_bytes"] / a["peak_bytes"], "gradient_bytes": a["param_bytes"]}
                         for a, b in zip(one, zb)],
              "1f1b_max_bytes": max_one, "zb-h1_max_bytes": max_zb, "max_ratio": max_zb / max_one,
              "passes_end_max_bytes": off}
    return lines, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pp=2 m=4 only, 4 blocks, seq_len 128: a smoke run")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro batch (default 1)")
    parser.add_argument("--layers", type=int, help="transformer blocks (default 8; --quick 4)")
    parser.add_argument("--d-model", type=int, default=128, help="hidden width (default 128)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 256; --quick 128)")
    parser.add_argument("--results", metavar="DIR", type=Path,
                        help="also write pipeline_memory-CPU-<date>.json and .md into DIR (e.g. bench/results)")
    args = parser.parse_args()
    layers = args.layers or (4 if args.quick else 8)
    seq_len = args.seq_len or (128 if args.quick else 256)
    # a small vocabulary: the blocks' activations, which the schedules hold differently, dominate the memory
    # (a 50k vocabulary's logits would make the last stage's one micro batch of logits the peak under both)
    config = GPTConfig(name="pipeline-memory", n_layer=layers, n_head=4, d_model=args.d_model, seq_len=seq_len,
                       vocab_size=512, attention_impl="torch")
    layouts = [(2, 4)] if args.quick else [(4, 8), (2, 4)]
    started = time.perf_counter()
    _import_before_fork()
    say = Transcript()

    say(f"pipeline activation memory on CPU (gloo), fp32: {layers} blocks, d_model {args.d_model}, n_head 4, "
        f"seq_len {seq_len}, vocab 512, micro batch {args.micro_batch}; peak live tensor memory of one train_batch's "
        f"passes above the step's start (torch.profiler [memory] events), after a warm-up step")
    records = []
    for pp, m in layouts:
        measured = run(pp, [(m, s) for s in SCHEDULES], config, args.micro_batch, 1234)
        lines, record = case_lines(pp, m, {s: measured[(m, s)] for s in SCHEDULES})
        for line in lines:
            say(line)
        records.append(record)
    if args.results:
        command = " ".join(["python -m bench.pipeline_memory", *sys.argv[1:]])
        # the default run as pipeline_memory-CPU-<date>; others named by what differs
        suffix = f"-mb{args.micro_batch}" if args.micro_batch != 1 else ""
        suffix += "-quick" if args.quick else ""
        for path in write_results(args.results, suffix, records, say.text(), command, time.perf_counter() - started,
                                  stem="pipeline_memory", title="Pipeline activation memory", device=DEVICE):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
