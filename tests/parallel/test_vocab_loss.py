"""At tp = 2 the padded, vocab-parallel model computes the unpadded one-process model, with the plain
loss and with the fused one (model/fused_loss.py through parallel.tensor.VocabParallelUnembedding), with
and without sequence parallelism, and with its blocks compiled (model.compile, CPU inductor): its
loss and every gradient, assembled from the two ranks' pieces, equal a float64 reference on the full (V, d) embedding (tests/helpers/reference_gpt.py), and the
padding rows' gradients are exactly zero. The fused loss alone, on a vocabulary shard with chunks that
do not divide the tokens, equals float64 autograd on the full logits. One 2-process run holds it all."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from model import GPTConfig, build
from reference_gpt import reference_loss_and_grads, rel_err

CONFIG = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=300, attention_impl="reference")
SEED = 5
CASES = {
    "plain": {},
    "plain-sequence-parallel": {"sequence_parallel": True},
    "fused": {"fused_loss": True},
    "fused-sequence-parallel": {"fused_loss": True, "sequence_parallel": True},
    "fused-compiled": {"fused_loss": True, "compile": True},  # model.compile: CPU inductor
}
V, VP, D, N = 300, 512, 16, 37  # padded to 128·tp = 256: each rank holds 256 rows, rank 1 only 44 real


def batch():
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, CONFIG.vocab_size, (3, 8), generator=gen)
    targets = torch.randint(0, CONFIG.vocab_size, (3, 8), generator=gen)
    targets[1, 4:] = -100  # ignored positions
    return idx, targets


def shard_inputs():
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(N, D, generator=gen), torch.randn(VP, D, generator=gen) * 0.5  # padding rows non-zero
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[[1, 2, 20]] = -100
    return h, w, targets


def model_case(topology, options: dict) -> dict:
    """Loss, evaluation loss, and {full name: (region of the full tensor, this rank's gradient of it,
    the largest gradient on the rank's padding)} for every parameter the rank holds."""
    from model.layers import Block
    from parallel.build import BuildOptions, build_model
    from parallel.naming import parameter_map

    options = dict(options)
    config = dataclasses.replace(CONFIG, compile=options.pop("compile", False))
    part = build_model(config, topology, SEED, "cpu", BuildOptions(**options))
    idx, targets = batch()
    loss = part(idx, targets)
    loss.backward()
    pieces = {}
    for local, shard in parameter_map(part, CONFIG, topology).items():
        if shard.tied:
            continue
        grad = part.get_parameter(local).grad
        padding = grad.clone()
        padding[shard.local_index] = 0
        pieces[shard.name] = (shard.index, grad[shard.local_index].clone(), padding.abs().max().item())
    part.eval()
    with torch.no_grad():
        eval_loss = part(idx, targets).item()
    compiled = [layer._compiled_call_impl is not None for layer in part.layers if isinstance(layer, Block)]
    return {"loss": loss.item(), "eval_loss": eval_loss, "pieces": pieces, "compiled": compiled}


def shard_case(topology, chunk: int) -> dict:
    """The fused loss on this rank's rows of W, with the tensor-parallel reductions; gradients of h
    (summed over ranks by copy_to_tp_region) and of the rank's rows."""
    from parallel.tensor import VocabParallelUnembedding

    h, w, targets = shard_inputs()
    rank, rows = topology.tp_rank, VP // 2
    unembedding = VocabParallelUnembedding(V, D, topology.tp_group, tag="test", fused_loss=True)
    with torch.no_grad():
        unembedding.weight.copy_(w[rank * rows : (rank + 1) * rows])
    x = h.clone().requires_grad_()
    loss = unembedding.loss(x.view(1, N, D), targets.view(1, N), chunk=chunk)
    loss.backward()
    return {"loss": loss.item(), "h_grad": x.grad, "w_grad": unembedding.weight.grad}


def worker() -> dict:
    from parallel.topology import Topology

    topology = Topology.create(tp=2)
    results = {name: model_case(topology, options) for name, options in CASES.items()}
    results["shards"] = {chunk: shard_case(topology, chunk) for chunk in (5, 64)}
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(worker, 2)


@pytest.fixture(scope="module")
def reference():
    model = build(CONFIG, seed=SEED)
    full = {name: p.detach() for name, p in model.named_parameters()}
    full["layers.0.wte.weight"] = full["layers.0.wte.weight"][: CONFIG.vocab_size]
    return reference_loss_and_grads(full, CONFIG, *batch())


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_loss_and_every_gradient_equal_the_unpadded_reference(ranks, reference, case):
    ref_loss, ref_grads = reference
    results = [r[case] for r in ranks]
    for r in results:
        assert r["compiled"] == [CASES[case].get("compile", False)] * CONFIG.n_layer  # not a silent eager fallback
        assert abs(r["loss"] - ref_loss) <= 1e-5 * ref_loss
        assert abs(r["eval_loss"] - ref_loss) <= 1e-5 * ref_loss  # evaluation: the same loss
    assert set(results[0]["pieces"]) == set(ref_grads)
    for name, want in ref_grads.items():
        got = torch.full(want.shape, float("nan"), dtype=torch.float64)
        for r in results:
            index, piece, padding = r["pieces"][name]
            assert padding == 0.0, f"{name}: padding rows got gradient {padding}"
            got[index] = piece.double()
        assert rel_err(got, want) <= 1e-5, f"{name}: relative error {rel_err(got, want)}"


@pytest.mark.parametrize("chunk", [5, 64])
def test_vocab_parallel_fused_loss_equals_float64_autograd_on_the_full_logits(ranks, chunk):
    h, w, targets = shard_inputs()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    want = F.cross_entropy(h64 @ w64[:V].T, targets)
    want.backward()
    results = [r["shards"][chunk] for r in ranks]
    w_grad = torch.cat([r["w_grad"] for r in results])  # (Vp, d), rank 0's rows first
    for r in results:
        assert abs(r["loss"] - want.item()) <= 1e-5 * want.item()
        assert rel_err(r["h_grad"], h64.grad) <= 1e-5  # every rank: the sum over ranks
    assert rel_err(w_grad[:V], w64.grad[:V]) <= 1e-5
    assert torch.count_nonzero(w_grad[V:]) == 0
