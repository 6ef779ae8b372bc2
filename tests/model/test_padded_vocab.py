"""The vocabulary padded to a multiple of 128 rows (model/vocab.py) computes the unpadded model.

Reference: tests/helpers/reference_gpt.py, a float64 GPT-2 forward on the full (V, d) embedding.
"""

import torch

from model import GPTConfig, build, count_parameters, generate
from parallel.naming import full_shapes, load_full_
from parallel.topology import Topology
from reference_gpt import reference_logits, reference_loss_and_grads, rel_err

CONFIG = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=300, attention_impl="reference")
V, VP = 300, 384


def batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (3, 8), generator=gen)
    targets = torch.randint(0, V, (3, 8), generator=gen)
    targets[0, :3] = -100  # ignored positions
    return idx, targets


def full_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors under their full names, the embedding cut to its V real rows by hand."""
    full = {name: p.detach() for name, p in model.named_parameters()}
    full["layers.0.wte.weight"] = full["layers.0.wte.weight"][:V]
    return full


def test_padded_rows_are_zero_and_only_the_real_vocabulary_is_named_and_counted():
    model = build(CONFIG, seed=3)
    wte = model.embedding.wte.weight
    assert wte.shape == (VP, 16) and model.head.lm_head.weight is wte
    assert torch.count_nonzero(wte[V:]) == 0 and torch.count_nonzero(wte[:V]) == V * 16
    assert full_shapes(CONFIG)["layers.0.wte.weight"] == (V, 16)  # what checkpoints and export hold
    per_block = 4 * 16 * 16 + 2 * 16 * 64 + (3 * 16 + 16 + 64 + 16) + 4 * 16
    assert count_parameters(model) == 2 * per_block + V * 16 + 8 * 16 + 2 * 16  # MFU counts V, not Vp
    # A full (V, d) tensor loads into the padded model with zero padding.
    given = {name: torch.randn(shape) for name, shape in full_shapes(CONFIG).items()}
    load_full_(model, given, CONFIG, Topology.create(tp=1))
    assert torch.equal(wte[:V], given["layers.0.wte.weight"]) and torch.count_nonzero(wte[V:]) == 0


def test_padded_model_loss_gradients_and_logits_equal_the_unpadded_reference():
    model = build(CONFIG, seed=3)
    idx, targets = batch()
    loss = model(idx, targets)
    loss.backward()
    ref_loss, ref_grads = reference_loss_and_grads(full_tensors(model), CONFIG, idx, targets)
    assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss)
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert torch.count_nonzero(grads["layers.0.wte.weight"][V:]) == 0  # padding gets no gradient at all
    grads["layers.0.wte.weight"] = grads["layers.0.wte.weight"][:V]
    assert set(grads) == set(ref_grads)
    errors = {name: rel_err(grads[name], ref_grads[name]) for name in ref_grads}
    assert max(errors.values()) <= 1e-5, errors
    with torch.no_grad():
        logits = model(idx)
        assert logits.shape == (3, 8, V)  # generation sees the real vocabulary only
        assert rel_err(logits, reference_logits({k: v.double() for k, v in full_tensors(model).items()}, CONFIG, idx)) <= 1e-5


def test_padded_columns_are_never_sampled():
    """Padding rows set to huge values (as a corrupted or foreign weight might hold) still cannot be
    drawn: the logits the sampler sees stop at V."""
    model = build(CONFIG, seed=3)
    with torch.no_grad():
        model.embedding.wte.weight[V:] = 1e4
    out = generate(model, torch.zeros(4, 1, dtype=torch.long), 7, temperature=1.0, top_k=None,
                   generator=torch.Generator().manual_seed(0))
    assert out.max() < V
