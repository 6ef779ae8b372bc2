"""Invariant 2 for the Triton kernel (impl="triton"), run on CPU through TRITON_INTERPRET=1: the very
kernels that run on the GPU, with one small block size (16), so every case crosses several blocks,
ragged last blocks, and masked and unmasked blocks of the band.

The interpreter's tl.dot does not handle bfloat16, so low precision is covered by float16 here
(same code path, other dtype); bfloat16 needs a GPU.
"""

import math
import os
import sys

# triton.jit reads TRITON_INTERPRET when each kernel is defined, triton.language's own helpers
# included, so it must be set before triton is first imported in this process. pytest collects
# this file before any other test that could import triton; the variable stays set for the process.
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/test_attention_triton.py could set "
                       "TRITON_INTERPRET=1; run this file in a pytest process of its own")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from model.attention import attention  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.layers import Block  # noqa: E402

HEAD_DIMS = (64, 80, 96, 128)
LENGTHS = (1, 17, 100, 130)
MASKS = {"causal": (True, None), "full": (False, None), "window": (True, 37), "band": (False, 37)}
TOL = 2e-4


def test_kernels_are_interpreted():
    from model import attention_triton

    assert attention_triton.INTERPRET


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
    """max |x − ref| / max(max |ref|, 1); the floor only matters where the exact gradient is 0."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def errors_vs_float64(shape, causal, window, dtype=torch.float32, seed=0):
    """Relative errors of (O, dQ, dK, dV) of impl="triton" against float64 autograd."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))  # (B, H, T, D)
    ins = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = attention(*ins, causal=causal, window=window, impl="triton")
    grads = torch.autograd.grad(out, ins, do.to(dtype))
    ref_ins = [x.detach().double().requires_grad_() for x in ins]
    ref = float64_attention(*ref_ins, causal, window)
    ref_grads = torch.autograd.grad(ref, ref_ins, do.to(dtype).double())
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    return [rel_err(x, r) for x, r in zip((out, *grads), (ref, *ref_grads))]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_triton_matches_float64(d, t, mask):
    causal, window = MASKS[mask]
    errs = errors_vs_float64((1, 1, t, d), causal, window)
    assert max(errs) < TOL, f"(O, dQ, dK, dV) relative errors {errs}"


def test_triton_float16_and_batch_heads():
    errs = errors_vs_float64((2, 2, 40, 80), True, 20, dtype=torch.float16)
    assert max(errs) < 2e-3, f"(O, dQ, dK, dV) relative errors {errs}"


@pytest.mark.parametrize("layer_index", [0, 1])  # dense, then banded (window 24)
def test_block_gradients_match_reference(layer_index):
    """A Block's parameter gradients (fused QKV weight included) with impl="triton" vs "reference";
    q, k, v reach the kernel as strided views of the fused projection."""
    config = dict(n_layer=2, n_head=2, d_model=128, seq_len=64, vocab_size=64,
                  attention_pattern="alternating", local_window=24)
    blocks = {}
    for impl in ("triton", "reference"):
        torch.manual_seed(0)
        blocks[impl] = Block(GPTConfig(**config, attention_impl=impl), layer_index)
    blocks["triton"].load_state_dict(blocks["reference"].state_dict())
    h = torch.randn(2, 45, 128)
    upstream = torch.randn(2, 45, 128)
    grads = {}
    for impl, block in blocks.items():
        block(h).backward(upstream)
        grads[impl] = {name: p.grad for name, p in block.named_parameters()}
    for name, ref in grads["reference"].items():
        assert rel_err(grads["triton"][name], ref.double()) < TOL, name


def poisoned_run(t, poisoned, causal, window):
    """Forward and backward with NaN keys and values at positions `poisoned`. A kernel that loads
    a block, even to mask it, turns 0·NaN into NaN; only a block skipped by the loop bounds stays clean."""
    q, k, v = (torch.randn(1, 1, t, 64) for _ in range(3))
    k[:, :, poisoned] = float("nan")
    v[:, :, poisoned] = float("nan")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, causal=causal, window=window, impl="triton")
    out.backward(torch.randn_like(out))
    return out, q.grad, k.grad, v.grad


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_window_skips_blocks_outside_the_band():
    # window 16, blocks of 16: query blocks from 32 on (and key blocks from 32 on, in dK/dV) never
    # reach the first key block, nor any query that sees it.
    out, dq, dk, dv = poisoned_run(128, slice(0, 16), causal=True, window=16)
    for name, x in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)):
        assert torch.isfinite(x[:, :, 32:]).all(), name
    assert torch.isnan(out[:, :, :16]).all()  # the poison does reach the queries that see it


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_causal_skips_blocks_above_the_diagonal():
    out, dq, _, _ = poisoned_run(128, slice(112, 128), causal=True, window=None)
    assert torch.isfinite(out[:, :, :112]).all() and torch.isfinite(dq[:, :, :112]).all()
    assert torch.isnan(out[:, :, 112:]).all()
