"""model.compile (model/compile.py): compiled blocks compute the eager model's loss and gradients;
the attention is a registered custom op; no compiler means eager with one warning; checkpoints
do not compare the switch."""

import dataclasses
import warnings

import pytest
import torch

from model import GPTConfig
from model.attention import band_limits
from model.attention_op import attention_forward
from model.compile import compile_blocks
from model.layers import Block
from model.modes import Float8
from parallel.build import BuildOptions, build_model
from parallel.topology import Topology
from reference_gpt import rel_err

CONFIG = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, vocab_size=64, attention_impl="torch")


def loss_and_grads(model, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def compiled_against_eager(options: BuildOptions) -> tuple[float, dict]:
    """The same model built eager and with model.compile, one batch through each: the relative difference of
    the compiled loss, and of each parameter's gradient, from eager's."""
    topology = Topology.create(tp=1)
    eager = build_model(CONFIG, topology, 7, "cpu", options)
    compiled = build_model(dataclasses.replace(CONFIG, compile=True), topology, 7, "cpu", options)
    assert all(block._compiled_call_impl is not None for block in compiled.layers if isinstance(block, Block))
    gen = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
    want_loss, want = loss_and_grads(eager, idx, targets)
    got_loss, got = loss_and_grads(compiled, idx, targets)
    return abs(got_loss - want_loss) / want_loss, {name: rel_err(got[name], want[name]) for name in want}


@pytest.mark.slow  # CPU inductor: C++ compiles of the block's forward and backward
def test_compiled_blocks_equal_eager_loss_and_every_gradient():
    loss_error, errors = compiled_against_eager(BuildOptions(fused_loss=True))
    assert loss_error <= 1e-5
    assert max(errors.values()) <= 1e-5, errors


def test_attention_custom_op_passes_the_library_checks():
    """Schema, fake (meta) shapes, registered autograd against the op's own eager run, on the packed layouts:
    qkv (B, T, H·3·D) in, the merged heads (B, T, H·D) out."""
    qkv = torch.randn(1, 6, 2 * 3 * 4, dtype=torch.float64, requires_grad=True)  # (B, T, H·3·D), H=2, D=4
    lo, hi = band_limits(6, True, 3)
    torch.library.opcheck(attention_forward, (qkv, 4, lo, hi, "torch", False))
    o = attention_forward(qkv, 4, lo, hi, "torch", False)[0]  # (B, T, H·D)
    q, k, v = qkv.view(1, 6, 2, 3, 4).permute(3, 0, 2, 1, 4).unbind(0)  # each (B, H, T, D)
    mask = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)
    reference = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~mask, float("-inf")).softmax(-1) @ v  # (B, H, T, D)
    assert torch.autograd.gradcheck(lambda x: attention_forward(x, 4, lo, hi, "torch", False)[0], (qkv,))
    assert rel_err(o, reference.transpose(1, 2).reshape(1, 6, 8)) <= 1e-12


def test_without_a_working_compiler_the_blocks_run_eager_with_one_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(torch, "compile", broken)
    blocks = [Block(CONFIG, 0)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compile_blocks(blocks, "cpu") is False
    assert [str(w.message) for w in caught] == [
        "model.compile=true: torch.compile is unavailable on cpu (RuntimeError: no C++ compiler found); "
        "the blocks run eager"
    ]
    assert all(block._compiled_call_impl is None for block in blocks)


def test_checkpoints_do_not_compare_the_compile_switch():
    from train.checkpoint import model_differences

    saved = dataclasses.asdict(CONFIG)
    assert model_differences(saved, dataclasses.replace(CONFIG, compile=True)) == []
    del saved["compile"]  # a checkpoint written before the switch existed
    assert model_differences(saved, CONFIG) == []


def test_model_compile_must_be_true_or_false():
    with pytest.raises(ValueError, match=r"^model.compile='yes': must be true or false$"):
        GPTConfig(compile="yes")


@pytest.mark.slow  # CPU inductor: C++ compiles of the block's forward and backward with its float8 products
def test_compiled_float8_blocks_equal_eager():
    """train.precision=fp8 with model.compile: the blocks' float8 casts and torch._scaled_mm products (what
    a GPU runs; model/float8.py) compiled, the loss and every gradient as eager computes them, up to a
    rare float8 rounding that fp32's last bit moves across a boundary (1e-4 of a tensor's largest element)."""
    loss_error, errors = compiled_against_eager(BuildOptions(fused_loss=True, fp8=Float8("tensorwise")))
    assert loss_error <= 1e-5
    assert max(errors.values()) <= 1e-4, errors


@pytest.mark.slow  # CPU inductor: C++ compiles of the pieces between the deferring linears and of the W products
def test_compiled_blocks_that_defer_their_weight_gradients_equal_eager():
    """Under a zero-bubble schedule (zb-h1, zb-v) the block linears defer W to a store: compiled, the graph
    breaks at each such linear (its backward must hand the store the products, which no graph can trace),
    the pieces between compile, and the store runs W compiled on its own (WeightGradStore.compile). The loss,
    the input-side gradients after B and every gradient after W equal eager's, in fp32; nothing is left in
    the store, and its W ran through torch.compile."""
    from model.weight_grads import WeightGradStore

    gen = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
    runs = {}
    for compiled in (False, True):
        store = WeightGradStore()
        model = build_model(dataclasses.replace(CONFIG, n_layer=2, compile=compiled), Topology.create(tp=1), 7, "cpu",
                            BuildOptions(fused_loss=True, weight_grads=store))
        loss = model(idx, targets)
        loss.backward()  # B: the deferring linears leave their weights' gradients to W
        after_b = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        store.seal()
        store.run_oldest()
        store.check_drained()
        runs[compiled] = loss.item(), after_b, {n: p.grad.clone() for n, p in model.named_parameters()}
        assert bool(store._compiled) == compiled  # W's products went through torch.compile
    (want_loss, want_b, want), (got_loss, got_b, got) = runs[False], runs[True]
    assert abs(got_loss - want_loss) <= 1e-5 * want_loss
    assert sorted(got_b) == sorted(want_b) and len(want_b) < len(want)  # the same parameters wait for W
    assert max(rel_err(got[n], want[n]) for n in want) <= 1e-5
    assert max(rel_err(got_b[n], want_b[n]) for n in want_b) <= 1e-5
