"""The float8 weight casts kept through a training step (model/float8_weights.py), on the ring layers
(parallel.tp_comm_overlap, parallel/ring_operands.py), tp = 2 on gloo.

A GPT in float8 (tensorwise, emulated products, bf16 weights) runs two micro batches, accumulating gradients, once
with every micro batch casting its weights and once inside a step of WeightCasts. The cast is deterministic, so
the loss and every gradient must be equal bit for bit; what changes is the work: inside the step each linear
reduces its W's amax once (its first forward, with x's: 8 bytes), later forwards reduce x's alone (4 bytes), and
no backward reduces W's again (outside a step each backward does: 4 bytes beside g's). After the step nothing is
kept; a second step after the weights change gives the gradients a fresh cast gives (a stale cast would not).
"""

from __future__ import annotations

import contextlib

import torch

from distributed import run_distributed
from model import GPT, GPTConfig
from model.float8_weights import WeightCasts
from model.modes import Float8, LayerModes
from parallel.comm import record_comm
from parallel.tensor import shard
from parallel.topology import Topology

CONFIG = GPTConfig(name="weight-casts-test", n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=300)
LINEARS = 4 * CONFIG.n_layer


def _micro_batches(seed: int) -> list:
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return [(tokens[i : i + 2, :-1], tokens[i : i + 2, 1:]) for i in (0, 2)]


def _amax_reductions(events) -> list[tuple[str, int]]:
    """The block linears' amax all-reduces: one or two fp32 numbers (the row layers' bias gradients are d)."""
    return sorted((e.phase, e.nbytes) for e in events if e.op == "all_reduce" and e.nbytes <= 8
                  and e.tag.rpartition(".")[2] in ("qkv", "proj", "fc"))


def worker() -> dict:
    topology = Topology.create(tp=2)
    casts = WeightCasts()
    with torch.device("meta"):
        model = GPT(CONFIG, modes=LayerModes(fp8=Float8(emulate=True, weight_casts=casts)))
    shard(model, topology, sequence_parallel=True, overlap=False, ring_overlap=True).materialize("cpu", 5)
    model.to(torch.bfloat16)
    out = {}
    for seed in (1, 2):  # two steps, the weights changed between them
        for inside in (False, True):
            model.zero_grad(set_to_none=True)
            with record_comm() as events, casts.step() if inside else contextlib.nullcontext():
                for inputs, targets in _micro_batches(seed):
                    model(inputs, targets).backward()
                kept_inside = len(casts)
            out[seed, inside] = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                                 "reductions": _amax_reductions(events), "kept": kept_inside, "after": len(casts)}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9).add_(0.01)
    return out


def test_kept_weight_casts_change_no_number_and_reduce_each_weight_once_per_step():
    for rank, result in enumerate(run_distributed(worker, 2)):
        for seed in (1, 2):
            fresh, kept = result[seed, False], result[seed, True]
            for name, grad in fresh["grads"].items():
                assert torch.equal(kept["grads"][name], grad), (rank, seed, name)
            assert kept["kept"] == LINEARS and kept["after"] == 0, rank  # one entry a weight, let go at the end
            micro_batches = 2
            assert fresh["reductions"] == sorted([("forward", 8)] * LINEARS * micro_batches
                                                 + [("backward", 4)] * 2 * LINEARS * micro_batches), rank
            assert kept["reductions"] == sorted([("forward", 8)] * LINEARS + [("forward", 4)] * LINEARS
                                                + [("backward", 4)] * LINEARS * micro_batches), rank
