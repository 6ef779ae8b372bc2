"""What gpt3d sets up for a GPU before and around DeepSpeed's engine, checked on the CPU."""

from __future__ import annotations

import pytest
import torch

from train.config.sections import OptimConfig, ParallelConfig, TrainConfig
from train.run.engine import clipping, deepspeed_config, owned_deepspeed_keys, written
from train.run.optimizer import ELSEWHERE, GIVEN_NORM, OWN_NORM
from train.runtime.device import order_cuda_queues
from train.runtime.resolve import Runtime

CPU = torch.device("cpu")


def config(precision: str = "fp32", zero: int = 0, **parallel) -> dict:
    train = TrainConfig(global_batch_size=8, micro_batch_size=2, precision=precision)
    return deepspeed_config(train, ParallelConfig(zero_stage=zero, **parallel), OptimConfig(), {}, 1, Runtime(CPU, precision))


@pytest.mark.parametrize("tp, layout, overlap, device, wanted", [
    (2, "manual", True, "auto", True),
    (8, "manual", True, "cuda", True),
    (1, "auto", True, "auto", True),  # tp not chosen yet: the layouts auto picks on GPUs split tensors
    (1, "manual", True, "cuda", False),  # no tensor parallelism: ZeRO's streams keep their queues
    (2, "manual", False, "cuda", False),  # nothing to order without overlap
    (2, "manual", True, "cpu", False),
    ("abc", "manual", True, "cuda", False),  # a bad value is the config checks' to refuse, not a crash here
])
def test_one_hardware_queue_only_where_tensor_parallel_overlap_needs_it(monkeypatch, tp, layout, overlap, device, wanted):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    import os

    assert order_cuda_queues(tp, layout, overlap, device) is wanted
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == ("1" if wanted else None)


def test_a_users_own_queue_count_is_kept(monkeypatch):
    import os

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # e.g. on Blackwell, where one queue is not wanted
    order_cuda_queues(2, "manual", True, "cuda")
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"


def test_deepspeeds_throughput_timer_is_off():
    """It synchronizes the device at the start and end of every micro batch."""
    assert config()["timers"] == {"throughput": {"enabled": False}}


@pytest.mark.parametrize("precision, zero, who, deepspeed_clip", [
    ("fp32", 0, OWN_NORM, 0.0), ("autocast", 0, OWN_NORM, 0.0), ("fp32", 1, ELSEWHERE, 1.0),
    ("bf16", 0, GIVEN_NORM, 0.0), ("bf16", 1, GIVEN_NORM, 0.0), ("bf16", 2, ELSEWHERE, 1.0), ("bf16", 3, ELSEWHERE, 1.0),
])
def test_the_gradient_is_clipped_once_by_whoever_computes_the_norm(precision, zero, who, deepspeed_clip):
    assert clipping(ParallelConfig(zero_stage=zero), Runtime(CPU, precision)) == who
    assert config(precision, zero)["gradient_clipping"] == deepspeed_clip


def test_the_deepspeed_keys_gpt3d_owns_are_those_its_config_writes_from_a_setting():
    """Derived from `written` over every precision, ZeRO stage, offload and pipeline: each key a run's
    config holds comes from a gpt3d setting (owned: the deepspeed group may not set it) or is one of
    gpt3d's own defaults (which it may change); the client objects are owned too."""
    owned = owned_deepspeed_keys()
    assert owned["train_batch_size"] == "train.global_batch_size"
    assert owned["zero_optimization.stage"] == "parallel.zero_stage"
    assert owned["bf16.enabled"] == owned["torch_autocast.enabled"] == owned["fp16.enabled"] == "train.precision"
    assert owned["pipeline.pipe_partitioned"] == "parallel.sequence_parallel"
    assert owned["zero_optimization.offload_optimizer"] == "parallel.offload_optimizer"
    assert owned["optimizer"] == owned["scheduler"] == "optim.*"
    assert not {"steps_per_print", "wall_clock_breakdown", "timers.throughput.enabled"} & set(owned)  # defaults
    bf16 = written(TrainConfig(precision="bf16"), ParallelConfig(zero_stage=1, offload_optimizer=True, pp=2,
                                                                  sequence_parallel=True), OptimConfig(), 1,
                   Runtime(CPU, "bf16"))
    assert {path for path, _, source in bf16 if source is not None} <= set(owned)
