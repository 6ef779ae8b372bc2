"""A training step reads from the device a fixed number of times, however many micro batches it has.

Every way a tensor's value reaches the host (item, float, int, bool, tolist, cpu, numpy) is counted
while the real run's step (train.loop.build, then TrainStep) runs batches of 1 and of 4 micro batches
(the engine's accumulation follows the batch, as under a batch-size ramp). On a GPU each read waits
for the device; a read per micro batch would make the count grow with them.
"""

from __future__ import annotations

import pytest
import torch

from cli import TINY
from distributed import run_distributed

READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")


def compose(corpus: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_resolvers

    register_resolvers()
    base = [o for o in TINY if not o.startswith(("data", "model.n_layer", "train.global", "train.micro"))]
    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="test"):
        return hydra_compose("config", overrides=[*base, "model.n_layer=2", "train.global_batch_size=4",
                                                  "data=files", f"data.paths=[{corpus}/*.txt]", "data.streams=1",
                                                  "train.eval_interval=0", "logging.wandb.mode=disabled", *overrides])


def count_reads(corpus: str, run_dir: str) -> dict:
    """{micro batches: (host reads in one training step, in evaluating one batch)}, after a first step."""
    from train import loop
    from train.config.spec import resolve

    counts = {"n": 0}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts["n"] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    trainer = loop.build(resolve(compose(corpus, ["train.micro_batch_size=1"]), run_dir))
    trainer.step(windows(4))  # the first step creates the optimizer's state
    result = {}
    for micro_batches in (1, 4, 1):
        counts["n"] = 0
        trainer.step(windows(micro_batches))
        step_reads = counts["n"]
        counts["n"] = 0
        trainer.step.evaluate([windows(micro_batches)])
        result.setdefault(micro_batches, []).append((step_reads, counts["n"]))
    trainer.batches.close()
    return result


def windows(n: int) -> torch.Tensor:
    return torch.randint(0, 50257, (n, 33), generator=torch.Generator().manual_seed(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from cli import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_host_reads_do_not_grow_with_micro_batches(tmp_path, corpus):
    counts = run_distributed(count_reads, 1, str(corpus), str(tmp_path / "run"), timeout=600)[0]
    one, four = counts[1], counts[4][0]
    assert one[0] == one[1], counts  # the count is steady
    assert four == one[0], counts
    assert one[0][0] >= 1 and one[0][1] >= 1  # the gradient norm and the evaluation's losses are read
