"""Invariant 2 for the CPU path (impl="torch", and the plain impl="reference"): forward and dQ, dK, dV
match a float64 autograd reference; a Block's parameter gradients match impl="reference"; memory
stays O(T·D); blocks outside the band are never touched."""

import re

import pytest
import torch

from model.attention import attention
from model.config import GPTConfig
from model.layers import Block

from attention_reference import HEAD_DIMS, LENGTHS, MASKS, TOL, errors_vs_float64, rel_err

@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("impl", ["torch", "sdpa", "reference"])  # reference: the baseline others compare to
def test_matches_float64(impl, d, t, mask):
    causal, window = MASKS[mask]
    errs = errors_vs_float64((2, 3, t, d), causal, window, impl)
    assert max(errs) < TOL, f"(O, dQ, dK, dV) relative errors {errs}"


def test_torch_low_precision_inputs():
    for dtype in (torch.bfloat16, torch.float16):
        errs = errors_vs_float64((1, 2, 100, 80), True, 37, "torch", dtype=dtype)
        assert max(errs) < 2e-2, f"{dtype}: (O, dQ, dK, dV) relative errors {errs}"


def test_auto_is_torch_on_cpu():
    q, k, v = torch.randn(3, 1, 2, 50, 64)
    assert torch.equal(attention(q, k, v, impl="auto"), attention(q, k, v, impl="torch"))


def test_bad_arguments_are_named():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="'auto', 'triton', 'torch', 'sdpa', 'reference'"):
        attention(q, q, q, impl="flash")
    with pytest.raises(ValueError, match="window=0"):
        attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="causal='no': must be True or False"):
        attention(q, q, q, causal="no")
    for bad in (q[0], q[..., :0]):  # 3-d; head dim 0
        with pytest.raises(ValueError, match=re.escape(f"shape {tuple(bad.shape)}: must be 4-d (B, H, T, D) with head "
                                                       "dim D ≥ 1")):
            attention(bad, bad, bad, impl="reference")


@pytest.mark.parametrize("layer_index", [0, 1])  # dense, then banded (window 16)
def test_block_gradients_match_reference(layer_index):
    config = dict(n_layer=2, n_head=2, d_model=128, seq_len=64, vocab_size=64,
                  attention_pattern="alternating", local_window=16)
    blocks = {}
    for impl in ("torch", "reference"):
        torch.manual_seed(0)
        blocks[impl] = Block(GPTConfig(**config, attention_impl=impl), layer_index).double()
    blocks["torch"].load_state_dict(blocks["reference"].state_dict())
    assert blocks["torch"].attn.window == (16 if layer_index else None)
    h = torch.randn(2, 45, 128, dtype=torch.float64)
    upstream = torch.randn(2, 45, 128, dtype=torch.float64)
    grads = {}
    for impl, block in blocks.items():
        block(h).backward(upstream)
        grads[impl] = {name: p.grad for name, p in block.named_parameters()}
    for name, ref in grads["reference"].items():
        assert rel_err(grads["torch"][name], ref) < 1e-10, name


def test_torch_saves_only_linear_memory():
    """The autograd graph of impl="torch" keeps q, k, v, O and LSE: O(T·D), never a (T, T) tensor."""
    b, h, t, d = 1, 2, 512, 64
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    saved = {}
    for impl in ("torch", "reference"):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            attention(q, k, v, impl=impl)
        saved[impl] = sum(sizes)
    assert saved["torch"] <= 4 * b * h * t * d + b * h * t
    assert saved["reference"] >= b * h * t * t  # the check can tell the difference


def test_torch_never_touches_keys_outside_the_band():
    """NaN in keys/values that no late query can see: a path that visits them, even masked, turns
    0·NaN into NaN; the query-block loop must skip them instead."""
    t, window, block = 512, 64, 128
    q, k, v = (torch.randn(1, 2, t, 64) for _ in range(3))
    k[:, :, :block] = float("nan")
    v[:, :, :block] = float("nan")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, causal=True, window=window, impl="torch")
    out.backward(torch.randn_like(out))
    late = slice(2 * block, None)  # query blocks whose band starts past the poisoned keys
    for name, x in (("O", out), ("dQ", q.grad), ("dK", k.grad), ("dV", v.grad)):
        assert torch.isfinite(x[:, :, late]).all(), name
    assert torch.isnan(out[:, :, :block]).all()  # and the poison does reach the queries that see it


def test_deterministic_flag_on_the_cpu_paths():
    """impl="torch" and "reference" are deterministic already: with the flag they stay exact against
    float64 and give the same bits twice. "sdpa" refuses the flag instead of ignoring it."""
    for impl in ("torch", "reference"):
        errs = errors_vs_float64((2, 3, 100, 64), True, 37, impl, deterministic=True)
        assert max(errs) < TOL, f"{impl}: (O, dQ, dK, dV) relative errors {errs}"
        runs = []
        for _ in range(2):
            gen = torch.Generator().manual_seed(1)
            q, k, v = (x.requires_grad_() for x in torch.randn(3, 2, 3, 100, 64, generator=gen))  # each (B, H, T, D)
            out = attention(q, k, v, causal=True, window=37, impl=impl, deterministic=True)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
        assert all(torch.equal(a, b) for a, b in zip(*runs)), impl
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="deterministic=True with impl='sdpa'"):
        attention(q, q, q, impl="sdpa", deterministic=True)


def test_deterministic_attention_config_key():
    assert GPTConfig().deterministic_attention is False
    assert GPTConfig(deterministic_attention=True, attention_impl="triton").deterministic_attention
    with pytest.raises(ValueError, match="model.deterministic_attention='yes'"):
        GPTConfig(deterministic_attention="yes")
    with pytest.raises(ValueError, match="model.attention_impl='sdpa'"):
        GPTConfig(deterministic_attention=True, attention_impl="sdpa")
