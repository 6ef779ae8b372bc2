"""Invariant 2 for the CPU path (impl="torch", and the plain impl="reference"): forward and dQ, dK, dV
match a float64 autograd reference; a Block's parameter gradients match impl="reference"; memory
stays O(T·D); blocks outside the band are never touched."""

import math

import pytest
import torch

from model.attention import attention
from model.config import GPTConfig
from model.layers import Block

HEAD_DIMS = (64, 80, 96, 128)
LENGTHS = (1, 17, 100, 130)
MASKS = {"causal": (True, None), "full": (False, None), "window": (True, 37), "band": (False, 37)}
TOL = 2e-4


def float64_attention(q, k, v, causal, window):
    """softmax(QKᵀ/√D + mask)V in float64, written out here independently of model code."""
    t = q.shape[-2]
    i = torch.arange(t)[:, None]  # (T, 1) query index
    j = torch.arange(t)[None, :]  # (1, T) key index
    visible = torch.ones(t, t, dtype=torch.bool)  # (T, T)
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= (i - j < window) & (j - i < window)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v  # (B, H, T, D)


def rel_err(x, ref):
    """max |x − ref| / max(max |ref|, 1). Unit-variance inputs give max |ref| ≈ 1–5; the floor only
    matters where the exact gradient is 0 (dQ, dK at T=1) and float32 leaves the rounding of dP − Δ."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def errors_vs_float64(shape, causal, window, impl, dtype=torch.float32, seed=0):
    """Relative errors of (O, dQ, dK, dV) of `impl` against float64 autograd on random inputs."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))  # (B, H, T, D)
    ins = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = attention(*ins, causal=causal, window=window, impl=impl)
    grads = torch.autograd.grad(out, ins, do.to(dtype))
    ref_ins = [x.detach().double().requires_grad_() for x in ins]
    ref = float64_attention(*ref_ins, causal, window)
    ref_grads = torch.autograd.grad(ref, ref_ins, do.to(dtype).double())
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    return [rel_err(x, r) for x, r in zip((out, *grads), (ref, *ref_grads))]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("impl", ["torch", "reference"])  # reference: the baseline others compare to
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
    with pytest.raises(ValueError, match="'auto', 'triton', 'torch', 'reference'"):
        attention(q, q, q, impl="flash")
    with pytest.raises(ValueError, match="window=0"):
        attention(q, q, q, window=0)


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
