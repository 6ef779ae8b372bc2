"""Sequence parallelism's collectives decomposed into ring steps behind the GEMM chunks (parallel.tp_comm_overlap,
parallel/overlap.py), at tp = 2 and 4.

gloo processes build the same GPT with sequence parallelism twice: the plain path (each LayerNorm gathers,
each row-parallel layer reduce-scatters, whole) and the ring overlap; in fp32 and with bf16 weights, with
selective recomputation and with the weight gradients deferred to a WeightGradStore (zb-h1, zb-v). Loss and
every local gradient must equal the plain path's (fp32 within 1e-5; bf16 within its rounding); the same
collectives of the same sizes must run; and the recorded steps must show every ring exchange issued before
the GEMM chunk it hides behind and waited on after that chunk ends: p − 1 exchanges for each column-parallel
layer's forward and input gradient and each row-parallel layer's forward and input gradient.
"""

from __future__ import annotations

import pytest
import torch

from model import GPT, GPTConfig
from model.modes import Float8, LayerModes
from model.weight_grads import WeightGradStore
from parallel.comm import record_comm, record_overlap
from parallel.tensor import shard
from parallel.topology import Topology
from distributed import run_distributed

CONFIG = GPTConfig(name="ring-overlap-test", n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=300)
SEED, BATCH = 5, 2
VARIANTS = [("fp32", 0, False), ("fp32", "selective", False), ("fp32", 0, True), ("bf16", "selective", True)]
# float8 (tensorwise, emulated products): the pieces travel quantized (parallel/ring_operands.py); "fp8" with bf16
# weights as train.precision=fp8 runs them, "fp8-fp32" with fp32 ones (sums rounded in fp32)
FP8_VARIANTS = [("fp8-fp32", 0, False), ("fp8-fp32", "selective", True), ("fp8", "selective", True)]
LAYERS = [f"layers.{i + 1}.{name}" for i in range(CONFIG.n_layer) for name in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(2))
    return tokens[:, :-1], tokens[:, 1:]


def _run(topology, ring: bool, precision: str, mode, deferred: bool) -> dict:
    store = WeightGradStore() if deferred else None
    fp8 = Float8(emulate=True) if precision.startswith("fp8") else None
    with torch.device("meta"):
        model = GPT(CONFIG, modes=LayerModes(activation_checkpointing=mode, weight_grads=store, fp8=fp8))
    shard(model, topology, sequence_parallel=True, overlap=False, ring_overlap=ring).materialize("cpu", SEED)
    if precision not in ("fp32", "fp8-fp32"):  # bf16 weights, as train.precision=bf16 and fp8 run them
        model.to(torch.bfloat16)
    with record_overlap() as steps, record_comm() as events:
        loss = model(*_batch())
        loss.backward()
    if store is not None:
        store.seal()
        store.run_oldest()
    return {"loss": loss.detach().float(), "grads": {name: p.grad for name, p in model.named_parameters()},
            "steps": steps, "collectives": sorted((e.op, e.phase, e.nbytes) for e in events),
            "gathered": {e.tag: e.nbytes for e in events if e.op == "all_gather"}}


def ring_worker(tp: int) -> dict:
    topology = Topology.create(tp=tp)
    return {(variant, ring): _run(topology, ring, *variant) for variant in VARIANTS + FP8_VARIANTS for ring in (False, True)}


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def ranks(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(ring_worker, request.param, request.param)


@pytest.mark.parametrize("variant", VARIANTS, ids=["fp32", "fp32-selective", "fp32-deferred", "bf16-selective-deferred"])
def test_loss_and_gradients_equal_the_plain_path(ranks, variant):
    tp, results = ranks
    tolerance = 1e-5 if variant[0] == "fp32" else 1e-2
    for rank, result in enumerate(results):
        plain, ring = result[variant, False], result[variant, True]
        torch.testing.assert_close(ring["loss"], plain["loss"], rtol=tolerance, atol=tolerance)
        assert ring["grads"].keys() == plain["grads"].keys()
        for name, grad in ring["grads"].items():
            scale = plain["grads"][name].abs().max().item()
            torch.testing.assert_close(grad, plain["grads"][name], rtol=tolerance, atol=tolerance * scale,
                                       msg=f"tp {tp} rank {rank}: {name}")
        assert ring["collectives"] == plain["collectives"], rank  # the same collectives, the same bytes


@pytest.mark.parametrize("variant", VARIANTS[:1] + VARIANTS[3:], ids=["fp32", "bf16-selective-deferred"])
def test_every_exchange_is_issued_before_its_gemm_chunk_and_waited_on_after_it(ranks, variant):
    tp, results = ranks
    for rank, result in enumerate(results):
        steps = result[variant, True]["steps"]
        assert result[variant, False]["steps"] == [], rank
        for layer in LAYERS:
            for what in ("forward", "input grad"):
                for step in range(1, tp):
                    label = f"{layer}:{what} {step}/{tp - 1}"
                    assert [s for s, t in steps if t == label] == ["issue", "gemm start", "gemm end", "wait"], (rank, label)
        assert len(steps) == len(LAYERS) * 2 * (tp - 1) * 4, rank


@pytest.mark.parametrize("variant", FP8_VARIANTS, ids=["fp8-fp32", "fp8-fp32-selective-deferred", "fp8-selective-deferred"])
def test_float8_pieces_travel_quantized_and_give_the_plain_float8_path(ranks, variant):
    """In float8 the ring sends the quantized pieces with the whole operand's scale: the float8 operands are those of
    the path that gathers in the compute dtype and quantizes the whole, so with fp32 sums loss and gradients equal
    it within 1e-5. With bf16 weights the ranks' partial sums round in bf16 in ring order (another order than the
    reduce-scatter's at tp = 4), and an element moved by a bf16 ulp can cross a float8 rounding boundary (e5m2 keeps
    2 mantissa bits: a step of up to 25%): the loss stays within 1e-4, gradients within 1e-2 of each tensor's
    largest element at tp = 2 (two terms: the same sums) and 1e-1 at tp = 4 (the fp32 variants show the operands
    agree). Every block gather moves a byte an element (the LayerNorms' gathers of the plain path, the dtype's
    size), and the exchanges keep their order."""
    tp, results = ranks
    tolerance = 1e-5 if variant[0] == "fp8-fp32" else 1e-2 if tp == 2 else 1e-1
    for rank, result in enumerate(results):
        plain, ring = result[variant, False], result[variant, True]
        torch.testing.assert_close(ring["loss"], plain["loss"], rtol=min(tolerance, 1e-4), atol=0)
        for name, grad in ring["grads"].items():
            scale = plain["grads"][name].abs().max().item()
            torch.testing.assert_close(grad, plain["grads"][name], rtol=tolerance, atol=tolerance * scale,
                                       msg=f"tp {tp} rank {rank}: {name}")
        size = 4 if variant[0] == "fp8-fp32" else 2
        for i in range(1, CONFIG.n_layer + 1):  # the LayerNorms' gathers against the ring's float8 pieces
            for norm, column in (("ln_1", "attn.qkv"), ("ln_2", "mlp.fc")):
                assert size * ring["gathered"][f"layers.{i}.{column}"] == plain["gathered"][f"layers.{i}.{norm}"], rank
        steps = ring["steps"]
        for layer in LAYERS:
            for what in ("forward", "input grad"):
                for step in range(1, tp):
                    label = f"{layer}:{what} {step}/{tp - 1}"
                    assert [s for s, t in steps if t == label] == ["issue", "gemm start", "gemm end", "wait"], (rank, label)
