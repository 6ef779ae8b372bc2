"""The fused unembedding + cross-entropy (model/fused_loss.py) equals the plain path: loss and the
gradients of h and W against float64 autograd on the full logits, for chunks that do not divide the
tokens and with ignored targets; through a whole tiny model against the unpadded float64 reference
(tests/helpers/reference_gpt.py); evaluation losses equal the plain logits path."""

import pytest
import torch
import torch.nn.functional as F

from model import GPTConfig
from model.fused_loss import fused_linear_cross_entropy
from parallel.build import BuildOptions, build_model
from parallel.topology import Topology
from reference_gpt import reference_loss_and_grads, rel_err

V, VP, D, N = 300, 384, 16, 37


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen)
    w = torch.randn(VP, D, generator=gen) * 0.5  # padding rows non-zero: only the mask keeps them out
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[[0, 7, 8, 30]] = -100
    return h, w, targets


@pytest.mark.parametrize("chunk", [5, 16, 37, 64])
def test_fused_loss_and_gradients_equal_float64_autograd(chunk):
    h, w, targets = inputs()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    want = F.cross_entropy(h64 @ w64[:V].T, targets)
    want.backward()
    h32, w32 = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = fused_linear_cross_entropy(h32, w32, targets, V, chunk=chunk)
    (2.5 * got).backward()  # the upstream gradient scales both
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    assert rel_err(h32.grad, 2.5 * h64.grad) <= 1e-5
    assert rel_err(w32.grad[:V], 2.5 * w64.grad[:V]) <= 1e-5
    assert torch.count_nonzero(w32.grad[V:]) == 0  # padding rows: exactly no gradient


def test_fused_loss_under_bf16_autocast_is_the_plain_autocast_loss():
    h, w, targets = inputs(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy(F.linear(h, w)[:, :V].float(), targets)
        fused = fused_linear_cross_entropy(h, w, targets, V, chunk=8)
    assert fused.dtype == torch.float32 and abs(fused.item() - plain.item()) <= 1e-3 * plain.item()


def test_fused_model_loss_and_every_gradient_equal_the_unpadded_reference_and_eval_equals_plain():
    config = GPTConfig(n_layer=2, n_head=2, d_model=D, seq_len=8, vocab_size=V, attention_impl="reference")
    topology = Topology.create(tp=1)
    fused = build_model(config, topology, 4, "cpu", BuildOptions(fused_loss=True))
    plain = build_model(config, topology, 4, "cpu", BuildOptions(fused_loss=False))
    gen = torch.Generator().manual_seed(3)
    idx, targets = torch.randint(0, V, (3, 8), generator=gen), torch.randint(0, V, (3, 8), generator=gen)
    targets[2, :5] = -100
    loss = fused(idx, targets)
    loss.backward()
    full = {name: p.detach() for name, p in fused.named_parameters()}
    full["layers.0.wte.weight"] = full["layers.0.wte.weight"][:V]
    ref_loss, ref_grads = reference_loss_and_grads(full, config, idx, targets)
    assert abs(loss.item() - ref_loss) <= 1e-5 * ref_loss
    grads = {name: p.grad for name, p in fused.named_parameters()}
    assert torch.count_nonzero(grads["layers.0.wte.weight"][V:]) == 0
    grads["layers.0.wte.weight"] = grads["layers.0.wte.weight"][:V]
    errors = {name: rel_err(grads[name], ref_grads[name]) for name in ref_grads}
    assert max(errors.values()) <= 1e-5, errors
    fused.eval(), plain.eval()
    with torch.no_grad():
        assert abs(fused(idx, targets).item() - plain(idx, targets).item()) <= 1e-6 * ref_loss
        torch.testing.assert_close(fused(idx), plain(idx), rtol=0, atol=0)  # logits: the same unembedding


def test_train_fused_loss_must_be_true_or_false():
    from hydra import compose, initialize_config_dir

    from config_checks import refusal
    from train.config.entry import CONFIG_DIR, register_config

    register_config()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        assert compose("config").train.fused_loss is True  # the default
    assert refusal(["train.fused_loss=sometimes"]) == "train.fused_loss='sometimes': must be true or false"
