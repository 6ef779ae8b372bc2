"""The end-of-run sample and python -m train.generate compute in the precision they are asked for.

On a GPU (train.precision=auto: bf16) decoding runs its matrix products under bf16 autocast; forced
on the CPU here, the head's logits must come out in bf16, and in fp32 without it.
"""

from __future__ import annotations

import torch
from distributed import run_distributed


def logits_dtypes(bf16: bool) -> set[torch.dtype]:
    from model import GPTConfig, build
    from parallel.topology import Topology
    from train.evaluation.sample import sample_text

    config = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=32)
    model, seen = build(config, "cpu", seed=1), set()
    model.head.register_forward_hook(lambda module, inputs, output: seen.add(output.dtype))
    sample_text(model, config, Topology.create(1, 1), "import os", 4, torch.device("cpu"), 0, bf16=bf16)
    return seen


def test_bf16_generation_computes_the_logits_in_bf16_and_fp32_generation_in_fp32():
    assert run_distributed(logits_dtypes, 1, True) == [{torch.bfloat16}]
    assert run_distributed(logits_dtypes, 1, False) == [{torch.float32}]
