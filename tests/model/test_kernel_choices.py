"""Autotuned kernel choices are recorded as JSON and pinned in another process (model/kernel_choices.py).

On the Triton interpreter (TRITON_INTERPRET=1, no GPU) an autotuner with two configs cannot benchmark:
there is no device to time them on, and it fails. A toy kernel with two configs therefore shows the
pin at work: the choice one process made (set here as the autotuner sets it after benchmarking),
recorded and pinned in a fresh process, is the config that process runs, with no benchmarking.
"""

import json
import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/model/test_kernel_choices.py could set TRITON_INTERPRET=1")
os.environ["TRITON_INTERPRET"] = "1"  # inherited by the processes run_distributed spawns

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from distributed import RankFailed, run_distributed  # noqa: E402
from model.kernel_choices import attention_choices, pin, pin_attention_choices, recorded  # noqa: E402

N = 64


@triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])
@triton.jit
def _double(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)


def tuned_and_recorded() -> dict:
    """What a process records after its autotuner chose the second config for n = N (its cache, keyed by
    n and the tensors' dtypes, as Triton keys it), through JSON as a checkpoint keeps it."""
    _double.cache[(N, "torch.float32", "torch.float32")] = _double.configs[1]
    return json.loads(json.dumps(recorded({"double": _double})))


def pinned_and_run(record: dict) -> tuple[torch.Tensor, dict]:
    pin({"double": _double}, record)
    x, y = torch.arange(float(N)), torch.empty(N)
    _double[lambda meta: (triton.cdiv(N, meta["BLOCK"]),)](x, y, N)
    return y, dict(_double.best_config.kwargs)


def test_a_recorded_choice_is_the_config_another_process_runs_without_benchmarking():
    record = run_distributed(tuned_and_recorded, 1)[0]
    second = _double.configs[1]
    assert record == {"double": [[[N, "torch.float32", "torch.float32"],
                                  {"kwargs": {"BLOCK": 32}, "num_warps": second.num_warps, "num_stages": second.num_stages}]]}
    y, chosen = run_distributed(pinned_and_run, 1, record)[0]
    assert chosen == {"BLOCK": 32} and torch.equal(y, 2 * torch.arange(float(N)))
    with pytest.raises(RankFailed, match="driver"):  # unpinned, the autotuner benchmarks: no device to time
        run_distributed(pinned_and_run, 1, {})


def test_attention_choices_are_empty_until_the_kernels_ran_and_refuse_unknown_kernels():
    if "model.attention_triton" not in sys.modules:
        assert attention_choices() == {}
    pin_attention_choices({})  # nothing to pin: nothing happens
    with pytest.raises(ValueError, match="'retired'"):
        pin_attention_choices({"retired": []})


def attention_tuned_and_saved() -> dict:
    """A process whose forward kernel chose a config for one key, as its autotuner leaves it, saved as a
    checkpoint's per-rank part (train/checkpoint/kernels.py)."""
    from model import attention_triton
    from model.attention_configs import FWD_TUNING
    from train.checkpoint.kernels import KernelChoices

    tuner = attention_triton.autotuners()["forward"]
    config = attention_triton.triton_configs([FWD_TUNING[64][1]], "MASK_N")[0]
    tuner.cache[(2048, 2048, 64, "torch.bfloat16", "torch.bfloat16")] = config
    return json.loads(json.dumps(KernelChoices().state_dict()))


def attention_restored(state: dict) -> dict:
    from model import attention_triton
    from train.checkpoint.kernels import KernelChoices

    KernelChoices().load_state_dict(state)
    return {key: (dict(config.kwargs), config.num_warps, config.num_stages)
            for key, config in attention_triton.autotuners()["forward"].cache.items()}


def test_a_checkpoint_carries_the_attention_kernels_choices_to_the_resumed_process():
    from model.attention_configs import FWD_TUNING
    from train.checkpoint.schema import rng_problem

    state = run_distributed(attention_tuned_and_saved, 1)[0]
    m, n, mask, warps, stages = FWD_TUNING[64][1]
    assert state == {"kernels": {"forward": [[[2048, 2048, 64, "torch.bfloat16", "torch.bfloat16"],
                                              {"kwargs": {"BLOCK_M": m, "BLOCK_N": n, "MASK_N": mask},
                                               "num_warps": warps, "num_stages": stages}]]}}
    rank = {"torch": "AA==", "python": [3, list(range(624)) + [0], None], **state}
    assert rng_problem({"ranks": [rank]}, None) is None  # rng.json's schema takes it
    assert "num_warps" in rng_problem({"ranks": [{**rank, "kernels": {"forward": [[[1], {"kwargs": {}}]]}}]}, None)
    restored = run_distributed(attention_restored, 1, state)[0]
    assert restored == {(2048, 2048, 64, "torch.bfloat16", "torch.bfloat16"): ({"BLOCK_M": m, "BLOCK_N": n, "MASK_N": mask},
                                                                           warps, stages)}
    assert run_distributed(attention_restored, 1, {})[0] == {}  # a checkpoint without choices pins nothing
