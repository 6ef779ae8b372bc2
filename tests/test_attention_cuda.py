"""Invariant 2 on a GPU: the compiled Triton kernel (not the interpreter) against float64 autograd,
in bfloat16 and float16, and one bf16 training step of the toy model against the fp32 CPU step.

Every test here needs CUDA; on a machine without it the whole file is skipped (and pytest reports
the skips). `bash bench/gpu_suite.sh` runs this file on a GPU. It must run in a pytest process
without TRITON_INTERPRET=1: the kernels are compiled for the device.
"""

import os

import pytest
import torch

from attention_reference import HEAD_DIMS, errors_vs_float64, rel_err

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels, not the interpreter"),
]

# Rounding the inputs to 8 (bf16) or 11 (fp16) mantissa bits is already in the reference, so these
# bound only the kernel's own rounding: P and dS are rounded to the input dtype before each matmul.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-4}
# Lengths that are not multiples of any block size (16–128), and one long enough for many blocks.
CUDA_LENGTHS = (1, 100, 333, 1025)
CUDA_MASKS = {"causal": (True, None), "window": (True, 256), "band": (False, 37), "full": (False, None)}


@pytest.mark.parametrize("mask", CUDA_MASKS)
@pytest.mark.parametrize("t", CUDA_LENGTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_matches_float64_on_gpu(dtype, d, t, mask):
    causal, window = CUDA_MASKS[mask]
    errs = errors_vs_float64((2, 3, t, d), causal, window, "triton", dtype=dtype, device="cuda", seed=t + d)
    assert max(errs) < TOLERANCE[dtype], f"(O, dQ, dK, dV) relative errors {errs}"


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_kernel_float32_matches_float64_on_gpu(d):
    errs = errors_vs_float64((1, 2, 300, d), True, None, "triton", dtype=torch.float32, device="cuda")
    assert max(errs) < TOLERANCE[torch.float32], f"(O, dQ, dK, dV) relative errors {errs}"


def test_kernel_writes_every_output_element():
    """NaN-poisoned output buffers from the caching allocator must be fully overwritten."""
    q, k, v = (torch.randn(1, 2, 257, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    from model.attention import attention

    torch.full((1 << 22,), float("nan"), device="cuda")  # freed: its block is reused for the outputs
    out = attention(q, k, v, causal=True, impl="triton")
    out.backward(torch.randn_like(out))
    for name, x in (("O", out), ("dQ", q.grad), ("dK", k.grad), ("dV", v.grad)):
        assert torch.isfinite(x).all(), name


def test_many_heads_times_batch_beyond_grid_limit():
    """B·H above 65,535 (CUDA's limit on grid axes 1 and 2) launches and stays exact."""
    errs = errors_vs_float64((1, 70_000, 17, 64), True, None, "triton", dtype=torch.bfloat16, device="cuda")
    assert max(errs) < TOLERANCE[torch.bfloat16], errs


def test_bf16_training_step_matches_fp32_cpu_step():
    """One AdamW step of the toy model: bf16 autocast with the Triton kernel on the GPU vs fp32 on the CPU
    with the reference attention. Losses before and after the step agree to bf16 accuracy."""
    from model import GPTConfig, build

    config = dict(n_layer=2, n_head=4, d_model=128, seq_len=128, vocab_size=512,
                  attention_pattern="alternating", local_window=32)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 512, (4, 129), generator=gen)  # (B, T+1)
    losses = {}
    for device, impl in (("cpu", "reference"), ("cuda", "triton")):
        model = build(GPTConfig(**config, attention_impl=impl), device=device, seed=7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)
        step = []
        for _ in range(2):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            step.append(loss.item())
        losses[device] = torch.tensor(step, dtype=torch.float64)
    assert rel_err(losses["cuda"], losses["cpu"]) < 1e-2, losses
    assert losses["cuda"][1] < losses["cuda"][0]  # the step moved the model downhill on its batch
