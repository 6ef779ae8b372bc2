"""A training step never waits for the device, however many micro batches it has; an evaluation once.

Counted while the real run's step (train.run.build.build, then TrainStep) runs batches of 1 and of 4
micro batches (the engine's accumulation follows the batch, as under a batch-size ramp), and while it
evaluates one batch of each:
  device syncs   get_accelerator().synchronize() and torch.cuda.synchronize() (DeepSpeed's throughput
                 timer made two per micro batch: 8 in a 4-micro-batch step before it was turned off)
  device reads   every way a tensor's value reaches the host (item, float, int, bool, tolist, cpu,
                 numpy, nonzero), except reads of torch's AdamW step counters if they are host tensors
                 (they are not: fused AdamW keeps them on the device and reads none)
On a GPU each sync or read waits for every kernel queued before it.

What a step reads (the counts the tests assert):
  fp32 (ZeRO-0)    0: ClippingAdamW takes the norm, clips and skips on the device (train/run/optimizer.py)
  bf16             0: so does DeepSpeed's bf16 optimizer as gpt3d runs it (train/run/bf16_optimizer.py)
  evaluation       1 per batch: its micro batches' losses read together (pp = 1), or the pipeline's
                   mean loss of the batch (pp > 1)
and no step or evaluation calls nonzero() (the losses find their target columns without it). The loop reads
each step's outcome later, with its record or one step late (train/guard/safeguards.py); the step bill
(bench/step_bill.py) counts the loop's reads too.
"""

from __future__ import annotations

import collections

import pytest
import torch
from cli import TINY
from distributed import run_distributed

READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy", "nonzero")


def compose(corpus: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_config

    register_config()
    base = [o for o in TINY if not o.startswith(("data", "model.n_layer", "train.global", "train.micro"))]
    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="test"):
        return hydra_compose("config", overrides=[*base, "model.n_layer=2", "train.global_batch_size=4",
                                                  "data=files", f"data.paths=[{corpus}/*.txt]", "data.streams=1",
                                                  "train.eval_interval=0", "logging.wandb.mode=disabled", *overrides])


class Counter:
    """Counts device syncs and device reads by kind while installed (see the module docstring)."""

    def __init__(self, host_tensors: set[int]):
        self.host_tensors, self.counts = host_tensors, collections.Counter()

    def install(self) -> None:
        from deepspeed.accelerator import get_accelerator

        for name in READS:
            self._wrap(torch.Tensor, name, name, calls_through=True)
        self._wrap(torch, "nonzero", "nonzero", calls_through=True)
        self._wrap(get_accelerator(), "synchronize", "sync", calls_through=True)
        self._wrap(torch.cuda, "synchronize", "sync", calls_through=False)  # no CUDA here to call

    def _wrap(self, owner, name: str, kind: str, calls_through: bool) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            first = args[0] if args else None
            if not (isinstance(first, torch.Tensor) and id(first) in self.host_tensors):
                self.counts[kind] += 1
            return original(*args, **kwargs) if calls_through else None

        setattr(owner, name, counted)

    def take(self) -> dict[str, int]:
        """{"syncs": n, "reads": n, "nonzero": n} since the last take."""
        syncs, nonzero = self.counts["sync"], self.counts["nonzero"]
        reads = sum(self.counts.values()) - syncs
        self.counts.clear()
        return {"syncs": syncs, "reads": reads, "nonzero": nonzero}


def count(corpus: str, run_dir: str, overrides: list[str]) -> dict:
    """{micro batches: [(counts of one training step, counts of evaluating one batch), …]}, after a
    first step (which creates the optimizer's state), for 1, 4, then 1 micro batches again."""
    from train.run.build import build
    from train.run.spec import resolve

    trainer = build(resolve(compose(corpus, ["train.micro_batch_size=1", *overrides]), run_dir))
    trainer.step(windows(4))
    inner = trainer.engine.optimizer
    inner = getattr(inner, "optimizer", inner)  # ours, inside DeepSpeed's bf16 optimizer if there is one
    steps = [state["step"] for state in inner.state.values() if "step" in state]
    assert steps and all(step.device.type == "cpu" and step.dim() == 0 for step in steps)
    counter = Counter({id(step) for step in steps})
    counter.install()
    result = {}
    for micro_batches in (1, 4, 1):
        trainer.step(windows(micro_batches))
        stepped = counter.take()
        trainer.step.evaluate([windows(micro_batches)])
        result.setdefault(micro_batches, []).append((stepped, counter.take()))
    trainer.batches.close()
    return result


def windows(n: int) -> torch.Tensor:
    return torch.randint(0, 50257, (n, 33), generator=torch.Generator().manual_seed(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from cli import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


NONE = {"syncs": 0, "reads": 0, "nonzero": 0}
ONE_READ = {"syncs": 0, "reads": 1, "nonzero": 0}


@pytest.mark.parametrize(
    "nproc, overrides",
    [(1, []), (1, ["train.precision=bf16"]), (2, ["train.precision=bf16", "parallel.pp=2"])],
    ids=["fp32", "bf16", "bf16-pp2"],
)
def test_a_step_never_waits_for_the_device_and_an_evaluation_once(tmp_path, corpus, nproc, overrides):
    """No read, sync or nonzero for a step of 1 or 4 micro batches, one read for an evaluation, on every rank."""
    for rank, counts in enumerate(run_distributed(count, nproc, str(corpus), str(tmp_path / "run"), overrides,
                                                  timeout=600)):
        for micro_batches, runs in counts.items():
            for stepped, evaluated in runs:
                assert stepped == NONE, (rank, micro_batches, stepped)
                assert evaluated == ONE_READ, (rank, micro_batches, evaluated)


def test_a_batch_reaches_the_cpu_device_unchanged():
    from train.run.step import to_device

    batch = torch.randint(0, 50257, (4, 33))
    assert to_device(batch, torch.device("cpu")) is batch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_batch_goes_to_the_gpu_without_waiting_for_the_queued_work():
    """Behind a kernel that keeps the GPU busy, the pinned non-blocking copy returns at once, where a copy
    from pageable memory waits for the kernel; measured against that blocking copy in the same run."""
    import time

    from train.run.step import to_device

    windows, device = torch.randint(0, 50257, (8, 2049)), torch.device("cuda")

    def host_seconds(copy) -> float:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time queued ahead of the copy
        started = time.perf_counter()
        copied = copy()
        seconds = time.perf_counter() - started
        torch.cuda.synchronize()
        assert torch.equal(copied.cpu(), windows)
        return seconds

    blocking = host_seconds(lambda: windows.to(device))
    assert host_seconds(lambda: to_device(windows, device)) < blocking / 10
