"""Tensor-parallel communication overlapped with compute, and selective recomputation at tp=2.

Two gloo processes build the same tp=2 GPT (with and without sequence parallelism) in four ways:
overlap on or off (parallel.overlap_communication), selective recomputation on or off. The
reference for each is the plain path, overlap off and nothing recomputed, as it ran before either
existed: loss and every local gradient equal bit for bit. The recorded steps show every
column-parallel layer's input-gradient reduction (all-reduce; under sequence parallelism
reduce-scatter) issued before its weight-gradient GEMM starts and waited on after it ends; the
bytes kept for backward drop by exactly model.layers.Block's count.

Built with a WeightGradStore (parallel.pipeline_schedule=zb-h1, model/weight_grads.py) the blocks'
linears leave their weight gradients to the store: the backward then runs every collective it runs
without the store (the input gradients' reductions stay on its path), W runs none, and after W every
gradient equals the plain path's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from model import GPT, GPTConfig
from model.modes import LayerModes
from model.weight_grads import WeightGradStore
from parallel.comm import record_comm, record_overlap
from parallel.tensor import shard
from parallel.topology import Topology
from distributed import run_distributed
from saved_bytes import saved_bytes

CONFIG = GPTConfig(name="overlap-test", n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=300)
SEED, BATCH, TP = 5, 2, 2
VARIANTS = [(False, 0), (True, 0), (True, "selective"), (False, "selective")]  # (overlap, activation_checkpointing)
COLUMN_LAYERS = [f"layers.{i + 1}.{name}" for i in range(CONFIG.n_layer) for name in ("attn.qkv", "mlp.fc")]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(2))
    return tokens[:, :-1], tokens[:, 1:]


def _saved_bytes(model: GPT) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for one micro batch's backward."""
    return saved_bytes(model, *_batch())


def overlap_worker() -> dict:
    topology = Topology.create(tp=TP)
    result = {}
    for sequence_parallel in (False, True):
        for overlap, mode in VARIANTS:
            with torch.device("meta"):
                model = GPT(CONFIG, modes=LayerModes(activation_checkpointing=mode))
            shard(model, topology, sequence_parallel=sequence_parallel, overlap=overlap).materialize("cpu", SEED)
            with record_overlap() as steps, record_comm() as events:
                loss = model(*_batch())
                loss.backward()
            result[sequence_parallel, overlap, mode] = {
                "loss": loss.detach(),
                "grads": {name: p.grad for name, p in model.named_parameters()},
                "steps": steps,
                "collectives": sorted((e.op, e.phase, e.nbytes) for e in events),
                "saved": _saved_bytes(model),
            }
        for mode in (0, "selective"):
            store = WeightGradStore()
            with torch.device("meta"):
                model = GPT(CONFIG, modes=LayerModes(activation_checkpointing=mode, weight_grads=store))
            shard(model, topology, sequence_parallel=sequence_parallel, overlap=True).materialize("cpu", SEED)
            with record_comm() as b_events:
                loss = model(*_batch())
                loss.backward()
            store.seal()
            deferred = sorted(name for name, p in model.named_parameters() if p.grad is None)
            with record_comm() as w_events:
                store.run_oldest()
            result[sequence_parallel, "deferred", mode] = {
                "loss": loss.detach(),
                "grads": {name: p.grad for name, p in model.named_parameters()},
                "deferred": deferred,
                "collectives": sorted((e.op, e.phase, e.nbytes) for e in b_events),
                "w_collectives": list(w_events),
            }
    return result


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(overlap_worker, TP)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("overlap, mode", VARIANTS[1:], ids=["overlap", "overlap+selective", "selective"])
def test_loss_and_gradients_equal_the_plain_path_bit_for_bit(ranks, sequence_parallel, overlap, mode):
    for rank, result in enumerate(ranks):
        plain, measured = result[sequence_parallel, False, 0], result[sequence_parallel, overlap, mode]
        assert torch.equal(measured["loss"], plain["loss"]), f"rank {rank}"
        assert measured["grads"].keys() == plain["grads"].keys()
        for name, grad in measured["grads"].items():
            assert torch.equal(grad, plain["grads"][name]), f"rank {rank}: {name}"


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["all-reduce", "reduce-scatter"])
@pytest.mark.parametrize("mode", [0, "selective"], ids=["plain", "selective"])
def test_input_gradient_reduction_is_issued_before_the_weight_gemm_and_waited_on_after(ranks, sequence_parallel, mode):
    for rank, result in enumerate(ranks):
        steps = result[sequence_parallel, True, mode]["steps"]
        for tag in COLUMN_LAYERS:
            assert [step for step, t in steps if t == tag] == ["issue", "gemm start", "gemm end", "wait"], (rank, tag)
        assert {t for _, t in steps} == set(COLUMN_LAYERS), rank
        assert result[sequence_parallel, False, mode]["steps"] == [], rank  # overlap off: today's path
        # the same collectives of the same sizes either way, only who issues them and when differs
        on, off = result[sequence_parallel, True, mode], result[sequence_parallel, False, mode]
        assert on["collectives"] == off["collectives"], rank


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_selective_recomputation_keeps_exactly_the_hand_count_fewer_bytes(ranks, sequence_parallel):
    """Per block on each rank: the two LayerNorm outputs (B·T·d each; kept under sequence parallelism,
    where they are gathered) and the rank's GELU output (B·T·d_ff/tp), float32."""
    b, t, d, d_ff = BATCH, CONFIG.seq_len, CONFIG.d_model, CONFIG.d_ff
    per_block = (0 if sequence_parallel else 2 * b * t * d) + b * t * d_ff // TP
    for rank, result in enumerate(ranks):
        plain, selective = result[sequence_parallel, True, 0], result[sequence_parallel, True, "selective"]
        assert plain["saved"] - selective["saved"] == CONFIG.n_layer * per_block * 4, rank


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("mode", [0, "selective"], ids=["plain", "selective"])
def test_deferred_weight_gradients_keep_the_collectives_in_backward_and_the_gradients_bit_for_bit(
        ranks, sequence_parallel, mode):
    linears = [f"layers.{i + 1}.{name}.weight" for i in range(CONFIG.n_layer)
               for name in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    column_biases = [f"layers.{i + 1}.{name}.bias" for i in range(CONFIG.n_layer) for name in ("attn.qkv", "mlp.fc")]
    for rank, result in enumerate(ranks):
        plain, deferred = result[sequence_parallel, True, mode], result[sequence_parallel, "deferred", mode]
        assert deferred["deferred"] == sorted(linears + column_biases), rank  # row layers add b after the sum
        assert deferred["collectives"] == plain["collectives"], rank
        assert deferred["w_collectives"] == [], rank
        assert torch.equal(deferred["loss"], plain["loss"]), rank
        for name, grad in deferred["grads"].items():
            assert torch.equal(grad, plain["grads"][name]), f"rank {rank}: {name}"
