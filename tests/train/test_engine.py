"""What gpt3d sets up for a GPU before and around DeepSpeed's engine, checked on the CPU."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from train.engine import clipping, deepspeed_config, order_cuda_queues
from train.optimizer import ELSEWHERE, GIVEN_NORM, OWN_NORM

CONFIG = {
    "train": {"global_batch_size": 8, "micro_batch_size": 2, "precision": "fp32"},
    "parallel": {"zero_stage": 0, "offload_optimizer": False, "sequence_parallel": False, "pp": 1},
    "optim": {"grad_clip": 1.0},
}


def cfg(**sections):
    return OmegaConf.merge(CONFIG, sections)


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
    config = deepspeed_config(cfg(), 1, torch.device("cpu"))
    assert config["timers"] == {"throughput": {"enabled": False}}


@pytest.mark.parametrize("precision, zero, who, deepspeed_clip", [
    ("fp32", 0, OWN_NORM, 0.0), ("autocast", 0, OWN_NORM, 0.0), ("fp32", 1, ELSEWHERE, 1.0),
    ("bf16", 0, GIVEN_NORM, 0.0), ("bf16", 1, GIVEN_NORM, 0.0), ("bf16", 2, ELSEWHERE, 1.0), ("bf16", 3, ELSEWHERE, 1.0),
])
def test_the_gradient_is_clipped_once_by_whoever_computes_the_norm(precision, zero, who, deepspeed_clip):
    run = cfg(train={"precision": precision}, parallel={"zero_stage": zero})
    assert clipping(run, torch.device("cpu")) == who
    assert deepspeed_config(run, 1, torch.device("cpu"))["gradient_clipping"] == deepspeed_clip
