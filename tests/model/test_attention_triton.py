"""Invariant 2 for the Triton kernel (impl="triton"), run on CPU through TRITON_INTERPRET=1: the very
kernels that run on the GPU, with small blocks (outer 16, inner 32, masked sub-blocks of 16), so
every case crosses several blocks, ragged last blocks, and masked and unmasked blocks of the band.

The interpreter's tl.dot does not handle bfloat16, so low precision is covered by float16 here
(same code path, other dtype); bfloat16 needs a GPU.
"""

import os
import sys

# triton.jit reads TRITON_INTERPRET when each kernel is defined, triton.language's own helpers
# included, so it must be set before triton is first imported in this process. pytest collects
# this file before any other test that could import triton; the variable stays set for the process.
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/model/test_attention_triton.py could set "
                       "TRITON_INTERPRET=1; run this file in a pytest process of its own")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402,F401  (a test dependency: missing, this file fails rather than skips)

from model.attention import attention  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.layers import Block  # noqa: E402

from attention_reference import (HEAD_DIMS, LENGTHS, MASKS, TOL, errors_vs_float64, float64_attention,  # noqa: E402
                                 packed_errors_vs_float64, rel_err, split_heads)


def test_kernels_are_interpreted():
    from model import attention_triton

    assert attention_triton.INTERPRET


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_triton_matches_float64(d, t, mask):
    causal, window = MASKS[mask]
    errs = errors_vs_float64((1, 1, t, d), causal, window, "triton")
    assert max(errs) < TOL, f"(O, dQ, dK, dV) relative errors {errs}"


def test_triton_float16_and_batch_heads():
    errs = errors_vs_float64((2, 2, 40, 80), True, 20, "triton", dtype=torch.float16)
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


def _graph_nodes(grad_fn):
    """Names of every autograd node reachable from grad_fn."""
    seen, stack = set(), [grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


@pytest.mark.parametrize("mask", ["causal", "band"])
def test_fused_qkv_gradient_is_written_as_one_buffer(mask):
    """q, k, v cut from one projection: the kernel's backward returns the projection's gradient
    itself, so autograd never stacks three gradients (UnbindBackward) and the result stays exact."""
    causal, window = MASKS[mask]
    errs, out, _ = packed_errors_vs_float64(2, 45, 3, 80, causal, window, "triton")
    assert max(errs) < TOL, f"(O, dQKV) relative errors {errs}"
    assert "UnbindBackward0" not in _graph_nodes(out.grad_fn)
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H, D) in memory: merging heads is a view


def test_slices_in_another_order_take_the_general_path_exactly():
    """Slices of one buffer passed as (k, q, v) are not a packed QKV: the separate-tensor path runs."""
    qkv = torch.randn(1, 40, 2 * 3 * 64, dtype=torch.float64).float().requires_grad_()
    q, k, v = split_heads(qkv, 2, 64)
    out = attention(k, q, v, causal=True, impl="triton")
    assert "UnbindBackward0" in _graph_nodes(out.grad_fn)
    do = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, do)
    ref_qkv = qkv.detach().double().requires_grad_()
    rq, rk, rv = split_heads(ref_qkv, 2, 64)
    ref = float64_attention(rk, rq, rv, True, None)
    (ref_grad,) = torch.autograd.grad(ref, ref_qkv, do.double())
    assert rel_err(out, ref) < TOL and rel_err(grad, ref_grad) < TOL


def test_tuning_key_buckets_lengths_and_keys_on_the_band():
    from model.attention import band_limits
    from model.attention_triton import tuning_key

    def key(t, causal, window):
        return tuning_key(t, *band_limits(t, causal, window))

    # every length in (1024, 2048] shares the dense causal key: no new benchmarking per length
    assert {key(t, True, None) for t in (1025, 1500, 2000, 2048)} == {(2048, 2049)}
    assert key(64, True, None) == (64, 65) and key(2049, True, None) == (4096, 4097)
    assert {key(t, True, 256) for t in (1025, 2048)} == {(2048, 256)}  # the window, not lo = −255
    assert key(2048, False, None) == (2048, 4097) and key(2048, False, 37) == (2048, 73)
    assert key(100, True, 256) == (128, 129)  # a window longer than the sequence is no window
