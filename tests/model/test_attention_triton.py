"""Invariant 2 for the Triton kernel (impl="triton"), run on CPU through TRITON_INTERPRET=1: the very
kernels that run on the GPU, with small blocks (outer 16, inner 32, masked sub-blocks of 16), so
every case crosses several blocks, ragged last blocks, and masked and unmasked blocks of the band.
Each feature is checked with the default backward (dQ added atomically) and the deterministic one
(dQ in a pass of its own), which must also give the same bits twice. The kernels run their sm_90
path (INTERPRET_HOPPER: the unmasked loops read tiles through tensor descriptors, the atomic
backward's dQ product is transposed); test_pointer_loads_match_float64 runs the other one, older GPUs'.

The interpreter's tl.dot does not handle bfloat16 (the kernel refuses it there), so low precision
is covered by float16 here (same code path, other dtype); bfloat16 needs a GPU.
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

from attention_reference import (HEAD_DIMS, LENGTHS, MASKS, TOL, errors_against_plain, errors_vs_float64,  # noqa: E402
                                 float64_attention, large_inputs, packed_errors_vs_float64, rel_err, split_heads)


BACKWARDS = {"atomic": False, "deterministic": True}  # id → the `deterministic` argument


def test_kernels_are_interpreted():
    from model import attention_triton

    assert attention_triton.INTERPRET
    assert attention_triton.INTERPRET_HOPPER  # the sm_90 path: tiles through tensor descriptors, dQ transposed


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("mask", ["causal", "band"])
def test_pointer_loads_match_float64(mask, backward, monkeypatch):
    """The path of GPUs before sm_90 (and of tensors a descriptor cannot take), which every other test
    here leaves aside: every tile through pointers and dQ = dS K, at a head dim padded to 128 columns
    and a ragged T. A spy on `_hopper_path` shows which path each launch took."""
    from model import attention_triton as at

    taken = []
    hopper_path = at._hopper_path
    monkeypatch.setattr(at, "_hopper_path", lambda *tensors: taken.append(hopper_path(*tensors)) or taken[-1])
    monkeypatch.setattr(at, "INTERPRET_HOPPER", False)
    causal, window = MASKS[mask]
    errs = errors_vs_float64((1, 2, 70, 80), causal, window, "triton", deterministic=BACKWARDS[backward])
    assert max(errs) < TOL, f"(O, dQ, dK, dV) relative errors {errs}"
    assert taken == [False, False]  # the forward's launch, the backward's launches
    monkeypatch.setattr(at, "INTERPRET_HOPPER", True)
    x, odd = torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 59)
    assert hopper_path(x, x, x) and not hopper_path(odd, odd, odd)  # 59 float32 columns: rows 236 bytes apart



@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_triton_matches_float64(d, t, mask, backward):
    causal, window = MASKS[mask]
    errs = errors_vs_float64((1, 1, t, d), causal, window, "triton", deterministic=BACKWARDS[backward])
    assert max(errs) < TOL, f"(O, dQ, dK, dV) relative errors {errs}"


@pytest.mark.parametrize("backward", BACKWARDS)
def test_triton_float16_and_batch_heads(backward):
    errs = errors_vs_float64((2, 2, 40, 80), True, 20, "triton", dtype=torch.float16,
                             deterministic=BACKWARDS[backward])
    assert max(errs) < 2e-3, f"(O, dQ, dK, dV) relative errors {errs}"


# Every head dim non-causal (where dQ was NaN), causal and banded at two head dims each; float32 at 64.
LARGE_SCORE_CASES = [(d, torch.float16, "full") for d in HEAD_DIMS] + \
    [(64, torch.float16, "causal"), (128, torch.float16, "causal"), (80, torch.float16, "band"),
     (96, torch.float16, "band"), (64, torch.float32, "full"), (64, torch.float32, "causal")]


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("d, dtype, mask", LARGE_SCORE_CASES, ids=str)
def test_large_scores_match_float64(d, dtype, mask, backward):
    """FlashAttention's backward-overflow test, harder: one head whose queries all point away from
    every key (each row's log-sum-exp near −100: e^(−LSE) overflows float32), one with its test's
    magnitudes (q·5, k·3, v·3). T = 50 ends in a partial key block of the backward (blocks of 16)
    and a partial query block of the forward. In float16 each of O, dQ, dK, dV, per head, is within
    FlashAttention's rule, 2× the error of plain PyTorch in float16 against float64. In float32 plain
    PyTorch's error (1e-6) is no yardstick: the kernel recomputes A in the backward from a score
    summed in another order than the forward's and LSE rounded once, ~1e-5 relative at scores
    near −150, which dK = dSᵀQ/√D (|Q| ≈ 200, cancelling sums) turns into ~1e-4 (measured at most
    1.0e-4; plain PyTorch differentiates the one A it computed): float32 is held to the suite's TOL."""
    causal, window = MASKS[mask]
    q, k, v, do = large_inputs(1, 50, d, dtype)  # (1, 2, 50, D)
    scores = q[:, 0].double() @ k[:, 0].double().transpose(-2, -1) / d ** 0.5  # (1, 50, 50)
    assert torch.logsumexp(scores, -1).max() < -89  # e^(−LSE) > 2^128: what made dQ NaN, unmasked
    errors = errors_against_plain(q, k, v, do, causal, window, "triton", deterministic=BACKWARDS[backward])
    if dtype == torch.float16:
        bad = [f"{name} head {h}: {mine:.2e} > 2 × {plain:.2e}" for name, per_head in errors.items()
               for h, (mine, plain) in enumerate(per_head) if not mine <= 2 * plain]
    else:
        bad = [f"{name} head {h}: {mine:.2e}" for name, per_head in errors.items()
               for h, (mine, _) in enumerate(per_head) if not mine < TOL]
    assert not bad, bad


def test_bad_inputs_are_refused_before_any_launch():
    """Under the interpreter bfloat16 would run and be wrong by orders of magnitude (its tl.dot has
    no bfloat16): refused, as is what the kernel cannot index."""
    from model.attention_triton import check_inputs

    x = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 takes float32 or float16, not torch.bfloat16"):
        attention(*(x.bfloat16(),) * 3, impl="triton")
    with pytest.raises(ValueError, match=r"takes 4-d q, k, v \(B, H, T, D\), not shape \(1, 8, 16\)"):
        check_inputs(x[0], x[0], x[0])
    empty = torch.randn(1, 1, 8, 0)
    with pytest.raises(ValueError, match="head dims 1 to 256, not 0"):
        check_inputs(empty, empty, empty)


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


def poisoned_run(t, poisoned, causal, window, deterministic):
    """Forward and backward with NaN keys and values at positions `poisoned`. A kernel that loads
    a block, even to mask it, turns 0·NaN into NaN; only a block skipped by the loop bounds stays clean."""
    q, k, v = (torch.randn(1, 1, t, 64) for _ in range(3))
    k[:, :, poisoned] = float("nan")
    v[:, :, poisoned] = float("nan")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, causal=causal, window=window, impl="triton", deterministic=deterministic)
    out.backward(torch.randn_like(out))
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_window_skips_blocks_outside_the_band(backward):
    # window 16, blocks of 16: query blocks from 32 on (and key blocks from 32 on, in dK/dV) never
    # reach the first key block, nor any query that sees it.
    out, dq, dk, dv = poisoned_run(128, slice(0, 16), causal=True, window=16, deterministic=BACKWARDS[backward])
    for name, x in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)):
        assert torch.isfinite(x[:, :, 32:]).all(), name
    assert torch.isnan(out[:, :, :16]).all()  # the poison does reach the queries that see it


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_causal_skips_blocks_above_the_diagonal(backward):
    out, dq, _, _ = poisoned_run(128, slice(112, 128), causal=True, window=None, deterministic=BACKWARDS[backward])
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


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("mask", ["causal", "band"])
def test_fused_qkv_gradient_is_written_as_one_buffer(mask, backward):
    """q, k, v cut from one projection: the kernel's backward returns the projection's gradient
    itself, so autograd never stacks three gradients (UnbindBackward) and the result stays exact."""
    causal, window = MASKS[mask]
    errs, out, _ = packed_errors_vs_float64(2, 45, 3, 80, causal, window, "triton", deterministic=BACKWARDS[backward])
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


def _gradients(packed, causal, window, deterministic, dtype=torch.float32):
    """Output and input gradients of one forward and backward on fixed inputs (seed 0): (B=1, H=2,
    T=77, D=96) as three tensors, or as slices of one fused projection when `packed` (several key and
    query blocks along T, where the two backwards sum dQ in different orders; two heads, so that the
    head strides are used)."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, 77, 2 * 3 * 96, generator=gen).to(dtype).requires_grad_()  # (B, T, H·3·D)
    do = torch.randn(1, 2, 77, 96, generator=gen).to(dtype)  # (B, H, T, D)
    q, k, v = split_heads(qkv, 2, 96)  # each (B, H, T, D)
    ins = (qkv,) if packed else tuple(x.detach().contiguous().requires_grad_() for x in (q, k, v))
    if not packed:
        q, k, v = ins
    out = attention(q, k, v, causal=causal, window=window, impl="triton", deterministic=deterministic)
    return (out, *torch.autograd.grad(out, ins, do))


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("mask", MASKS)
def test_deterministic_backward_gives_the_same_bits_twice(mask, packed):
    """Two runs of the deterministic backward on the same inputs agree bit for bit, and agree with the
    atomic backward to float32 rounding (the same gradients, summed in another order)."""
    causal, window = MASKS[mask]
    first = _gradients(packed, causal, window, deterministic=True)
    second = _gradients(packed, causal, window, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    atomic = _gradients(packed, causal, window, deterministic=False)
    assert torch.equal(first[0], atomic[0])  # the forward is the same code
    assert all(rel_err(a, b.double()) < 1e-5 for a, b in zip(first[1:], atomic[1:]))


def test_deterministic_float16_gives_the_same_bits_twice():
    first, second = (_gradients(True, True, 37, deterministic=True, dtype=torch.float16) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(x.dtype == torch.float16 for x in first)


class _Forbidden:
    """Stands in for a kernel that must not be launched: indexing it (kernel[grid]) fails the test."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"{self.name} was launched")


@pytest.mark.parametrize("backward", BACKWARDS)
def test_each_backward_launches_only_its_own_kernels(backward, monkeypatch):
    """deterministic=True never launches the kernel with atomic dQ adds; the default never launches the
    separate dQ pass (so the exactness tests above do test two different backwards)."""
    from model import attention_triton as at

    unused = ("_bwd_kernel",) if BACKWARDS[backward] else ("_bwd_kv_kernel", "_bwd_dq_kernel")
    for name in unused:
        monkeypatch.setattr(at, name, _Forbidden(name))
    errs = errors_vs_float64((1, 2, 50, 64), True, None, "triton", deterministic=BACKWARDS[backward])
    assert max(errs) < TOL, f"(O, dQ, dK, dV) relative errors {errs}"


def test_model_deterministic_attention_reaches_the_kernel(monkeypatch):
    """model.deterministic_attention=true makes the model's blocks use the deterministic backward: with
    the atomic-dQ kernel forbidden, a GPT's backward still runs, and gives the same bits twice."""
    from model import GPTConfig, build
    from model import attention_triton as at

    monkeypatch.setattr(at, "_bwd_kernel", _Forbidden("_bwd_kernel"))
    config = GPTConfig(name="det", n_layer=2, n_head=2, d_model=64, seq_len=40, vocab_size=128,
                       attention_impl="triton", deterministic_attention=True)
    tokens = torch.randint(0, 128, (2, 41), generator=torch.Generator().manual_seed(0))  # (B, T+1)
    grads = []
    for _ in range(2):
        model = build(config, "cpu", 0)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(AssertionError):  # the default backward is the forbidden kernel: the spy has teeth
        model = build(GPTConfig(**{**vars(config), "deterministic_attention": False}), "cpu", 0)
        model(tokens[:, :-1], tokens[:, 1:]).backward()


def gpu_configs(head_dim: int) -> list[dict]:
    """For each position i of the tuning lists at this head dim: every kernel's i-th GPU config
    (the block sizes the autotuner chooses among on a GPU), as triton.Configs by kernel name."""
    from model import attention_triton as kernels
    from model.attention_configs import KERNELS, candidates

    per_kernel = {name: kernels.triton_configs(candidates(tuning, head_dim), mask)
                  for name, (tuning, mask) in KERNELS.items()}
    return [{name: configs[i] for name, configs in per_kernel.items()} for i in range(3)]


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("mask", ["causal", "window"])
@pytest.mark.parametrize("d", [64, 128])
def test_triton_matches_float64_at_the_gpus_block_configs(d, mask, backward):
    """The kernels with the block sizes they run with on a GPU (outer blocks of up to 128, masked
    sub-blocks, every candidate of the tuning lists), on the interpreter: T = 300 crosses several outer
    blocks and ends in a ragged one; the window (37) makes every block a band edge or skips it."""
    from model.attention_triton import autotuners

    causal, window = MASKS[mask]
    tuners = autotuners()
    kept = {name: tuner.configs for name, tuner in tuners.items()}
    try:
        for configs in gpu_configs(d):
            for name, config in configs.items():
                tuners[name].configs = [config]  # one candidate: the autotuner runs it, benchmarking nothing
            errs = errors_vs_float64((1, 2, 300, d), causal, window, "triton", deterministic=BACKWARDS[backward])
            assert max(errs) < TOL, (configs, f"(O, dQ, dK, dV) relative errors {errs}")
    finally:
        for name, configs in kept.items():
            tuners[name].configs = configs
