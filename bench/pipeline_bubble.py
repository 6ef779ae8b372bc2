"""Pipeline bubble benchmark: DeepSpeed's 1F1B schedule, measured against its prediction.

  python -m bench.pipeline_bubble           # pp ∈ {2, 4}, m ∈ {1, 2, 4, 8}
  python -m bench.pipeline_bubble --quick   # pp ∈ {2, 4}, m ∈ {1, 4}: under 90 s on CPU

With pp equal stages, m micro batches per step, and no communication cost, 1F1B keeps each stage
busy for m·(t_f + t_b) of a step that lasts (m + pp − 1)·(t_f + t_b), so

    predicted bubble = (pp − 1) / (m + pp − 1).

Method. For each pp, pp forked CPU processes (gloo) run a deepspeed.pipe.PipelineModule of pp
identical stages through deepspeed.initialize → PipelineEngine.train_batch, once per m
(gradient_accumulation_steps = m). A stage's work is a wait, not compute: its forward sleeps t_f
and its backward sleeps t_b (a custom autograd.Function). A sleeping process leaves the CPU free,
so the stages overlap as they would on pp devices even on a 2-core machine. Each stage adds up the
time it spends in those sleeps (busy) and each rank times train_batch after a barrier (step), so

    measured bubble of a stage = 1 − busy / step,

averaged over stages and over the steps after a warm-up step. It includes everything that is not
the stages' own work: DeepSpeed's schedule and Python overhead, p2p sends and receives, the loss
broadcast and the optimizer step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = (1, 8, 16)  # one micro batch of activations: (micro batch, tokens, hidden)


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps stage.t_f and backward stage.t_b, adding both to stage.busy."""

    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        stage.wait(stage.t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.stage.wait(ctx.stage.t_b)
        return grad, None


class SleepStage(torch.nn.Module):
    """One pipeline stage: a scalar weight (so the optimizer has a parameter) and a timed wait."""

    def __init__(self, t_f: float, t_b: float):
        super().__init__()
        self.t_f, self.t_b, self.busy = t_f, t_b, 0.0
        self.scale = torch.nn.Parameter(torch.ones(1))

    def wait(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy += time.perf_counter() - start

    def forward(self, x):
        return _Sleep.apply(x * self.scale, self)


def mse(outputs, labels):
    return ((outputs - labels) ** 2).mean()


def predicted_bubble(pp: int, m: int) -> float:
    return (pp - 1) / (m + pp - 1)


def measure(pp: int, m: int, t_f: float, t_b: float, steps: int) -> list[tuple[float, float]]:
    """This rank's (busy, step) seconds in each of `steps` train_batch calls, after one warm-up."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    module = PipelineModule(
        layers=[LayerSpec(SleepStage, t_f, t_b) for _ in range(pp)],
        num_stages=pp,
        loss_fn=mse,
        partition_method="uniform",
    )
    config = {
        "train_batch_size": m * SHAPE[0],
        "train_micro_batch_size_per_gpu": SHAPE[0],
        "gradient_accumulation_steps": m,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    (stage,) = [layer for layer in module.modules() if isinstance(layer, SleepStage)]
    data = itertools.repeat((torch.randn(SHAPE), torch.randn(SHAPE)))
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        stage.busy = 0.0
        start = time.perf_counter()
        engine.train_batch(data)
        times.append((stage.busy, time.perf_counter() - start))
    return times[1:]


def _rank_main(rank, pp, port, ms, t_f, t_b, steps, results):
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # DeepSpeed's banners; results go through `results`
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(pp), LOCAL_WORLD_SIZE=str(pp),
    )
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    for m in ms:
        gathered = [None] * pp
        dist.all_gather_object(gathered, measure(pp, m, t_f, t_b, steps))
        if rank == 0:
            results.put((m, gathered))
    dist.destroy_process_group()


def run(pp: int, ms: list[int], t_f: float, t_b: float, steps: int) -> dict[int, list]:
    """{m: [[(busy, step) for each step] for each stage]} from pp forked ranks."""
    results = mp.get_context("fork").SimpleQueue()
    args = (pp, _free_port(), ms, t_f, t_b, steps, results)
    mp.start_processes(_rank_main, args=args, nprocs=pp, start_method="fork")
    return dict(results.get() for _ in ms)


def _import_before_fork() -> None:
    """Import DeepSpeed, and torch._dynamo (which torch.optim imports on first use), once, here:
    the forked ranks inherit them instead of each spending seconds (tens, on a busy 2-core
    machine) importing its own."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed.pipe  # noqa: F401
    import torch._dynamo  # noqa: F401
    from deepspeed.utils import logger

    from train.engine import skip_shared_memory_op

    logger.setLevel("WARNING")
    skip_shared_memory_op()  # as a training run does: no C++ build at start-up


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m ∈ {1, 4} and 3 steps: a smoke run")
    parser.add_argument("--t-forward", type=float, default=20.0, help="a stage's forward, ms (default 20)")
    parser.add_argument("--t-backward", type=float, default=40.0, help="a stage's backward, ms (default 40)")
    parser.add_argument("--steps", type=int, help="measured steps per case, after one warm-up (default 5; --quick 3)")
    args = parser.parse_args()
    ms = [1, 4] if args.quick else [1, 2, 4, 8]
    steps = args.steps or (3 if args.quick else 5)
    t_f, t_b = args.t_forward / 1e3, args.t_backward / 1e3
    _import_before_fork()

    print(f"pipeline bubble, DeepSpeed 1F1B on CPU (gloo): stage forward {args.t_forward:g} ms, backward "
          f"{args.t_backward:g} ms, {steps} steps after a warm-up; measured = 1 − stage busy / step")
    print(f"{'pp':>3} {'m':>3} {'predicted':>10} {'measured':>9} {'worst stage':>12} {'ratio':>6} "
          f"{'step ms':>8} {'ideal ms':>9}", flush=True)
    for pp in (2, 4):
        for m, per_stage in run(pp, ms, t_f, t_b, steps).items():
            stage_bubbles = [sum(1 - busy / step for busy, step in times) / steps for times in per_stage]
            measured, predicted = sum(stage_bubbles) / pp, predicted_bubble(pp, m)
            step_ms = sum(step for times in per_stage for _, step in times) / (pp * steps) * 1e3
            ideal_ms = (m + pp - 1) * (t_f + t_b) * 1e3
            print(f"{pp:>3} {m:>3} {predicted:>10.3f} {measured:>9.3f} {max(stage_bubbles):>12.3f} "
                  f"{measured / predicted:>6.2f} {step_ms:>8.1f} {ideal_ms:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
