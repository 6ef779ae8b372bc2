"""Selective activation recomputation (activation_checkpointing="selective") on one process.

The reference is the same model with nothing recomputed: the loss and every gradient must be equal
bit for bit (torch.equal, fp32 on the CPU), and the bytes autograd keeps for backward must be the
reference's less exactly the hand count of model.layers.Block's docstring, 2·B·T·d + B·T·d_ff
float32 elements per block (the two LayerNorm outputs and the GELU output).
"""

from __future__ import annotations

import pytest
import torch

from model import GPTConfig
from model.gpt import build
from model.modes import LayerModes
from saved_bytes import saved_bytes

CFG = GPTConfig(name="toy", n_layer=2, n_head=2, d_model=32, seq_len=32, vocab_size=100)
MICRO_BATCH = 2


def _tokens(cfg: GPTConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=torch.Generator().manual_seed(3))


def _loss_and_grads(cfg: GPTConfig, mode) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build(cfg, "cpu", seed=1, modes=LayerModes(activation_checkpointing=mode))
    tokens = _tokens(cfg)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _saved_bytes(cfg: GPTConfig, mode) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for one micro batch's backward."""
    model = build(cfg, "cpu", seed=1, modes=LayerModes(activation_checkpointing=mode))
    tokens = _tokens(cfg)
    return saved_bytes(model, tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_selective_recomputation_gives_the_same_loss_and_gradients_bit_for_bit(impl, activation):
    cfg = GPTConfig(**{**CFG.__dict__, "attention_impl": impl, "activation": activation})
    plain_loss, plain_grads = _loss_and_grads(cfg, 0)
    loss, grads = _loss_and_grads(cfg, "selective")
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_selective_recomputation_keeps_exactly_the_hand_count_fewer_bytes(activation):
    cfg = GPTConfig(**{**CFG.__dict__, "activation": activation})
    b, t, d, d_ff = MICRO_BATCH, cfg.seq_len, cfg.d_model, cfg.d_ff
    per_block = 2 * b * t * d + (b * t * d_ff if activation == "gelu" else 0)  # float32 elements
    assert _saved_bytes(cfg, 0) - _saved_bytes(cfg, "selective") == cfg.n_layer * per_block * 4

