"""Invariant 2 on a GPU: the compiled Triton kernel (not the interpreter) against float64 autograd,
in bfloat16 and float16, and one bf16 training step of the toy model against the fp32 CPU step.

Every test here needs CUDA; on a machine without it the whole file is skipped (and pytest reports
the skips). `bash bench/gpu_suite.sh` runs this file on a GPU. It must run in a pytest process
without TRITON_INTERPRET=1 (the kernels are compiled for the device), so on its own, not together
with tests/model/test_attention_triton.py.

Autotuning is off (GPT3D_TRITON_AUTOTUNE=0, set here before the kernels are imported): each kernel
runs its committed TABLE entry for the head dim and T bucket (model/attention_configs.py), so a new
shape costs at most one compile and no benchmarking. Two tests cover the rest: one runs every config
of the tuning lists and the table, one runs the real autotuner in a fresh process and checks that
lengths in one power-of-two bucket share one tuned choice.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("GPT3D_TRITON_AUTOTUNE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from attention_reference import (HEAD_DIMS, errors_against_plain, errors_vs_float64, large_inputs,  # noqa: E402
                                 packed_errors_vs_float64, rel_err)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels, not the interpreter"),
]

# Rounding the inputs to 8 (bf16) or 11 (fp16) mantissa bits is already in the reference, so these
# bound only the kernel's own rounding: P and dS are rounded to the input dtype before each matmul.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
# Lengths that are not multiples of any block size (16–128), and one long enough for many blocks.
CUDA_LENGTHS = (1, 100, 333, 1025)
CUDA_MASKS = {"causal": (True, None), "window": (True, 256), "band": (False, 37), "full": (False, None)}
REPO = Path(__file__).resolve().parents[2]


def test_autotuning_is_off_here_and_each_kernel_runs_its_table_entry():
    from model import attention_configs as ac
    from model import attention_triton as at
    from model.attention import attention

    assert not at.AUTOTUNE
    q, k, v = (torch.randn(1, 2, 300, 80, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    attention(q, k, v, causal=True, impl="triton").sum().backward()
    for name, tuner in at.autotuners().items():
        if name in ("forward", "backward"):  # the default backward: the key-block kernel with atomic dQ
            best = tuner.best_config
            entry = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.kwargs[ac.KERNELS[name][1]],
                     best.num_warps, best.num_stages)
            assert entry == ac.chosen(name, 80, 512), name
        assert not getattr(tuner, "configs_timings", None), name  # nothing benchmarked


@pytest.mark.parametrize("mask", CUDA_MASKS)
@pytest.mark.parametrize("t", CUDA_LENGTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_matches_float64_on_gpu(dtype, d, t, mask):
    causal, window = CUDA_MASKS[mask]
    errs = errors_vs_float64((2, 3, t, d), causal, window, "triton", dtype=dtype, device="cuda", seed=t + d)
    assert max(errs) < TOLERANCE[dtype], f"(O, dQ, dK, dV) relative errors {errs}"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("mask", CUDA_MASKS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_large_scores_within_twice_plain_pytorchs_error(dtype, d, mask, deterministic):
    """FlashAttention's backward-overflow rule on the GPU: queries pointing away from every key (row
    log-sum-exps near −100) and its test's magnitudes, T = 333 (a partial last block at every block
    size): O, dQ, dK, dV per head within 2× plain PyTorch's error in the same precision."""
    causal, window = CUDA_MASKS[mask]
    errors = errors_against_plain(*large_inputs(2, 333, d, dtype, seed=d, device="cuda"), causal, window,
                                  "triton", deterministic=deterministic)
    bad = [f"{name} head {h}: {mine:.2e} > 2 × {plain:.2e}" for name, per_head in errors.items()
           for h, (mine, plain) in enumerate(per_head) if not mine <= 2 * plain]
    assert not bad, bad


@pytest.mark.parametrize("mask", CUDA_MASKS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_deterministic_kernel_matches_float64_and_repeats_its_bits(dtype, d, mask):
    """deterministic=True on the GPU: exact against float64, and a second run gives the same bits (the
    default backward's atomic dQ adds need not: on a GPU programs finish in any order)."""
    causal, window = CUDA_MASKS[mask]
    errs = errors_vs_float64((2, 3, 1025, d), causal, window, "triton", dtype=dtype, device="cuda", seed=d,
                             deterministic=True)
    assert max(errs) < TOLERANCE[dtype], f"(O, dQ, dK, dV) relative errors {errs}"
    from model.attention import attention

    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v, do = (torch.randn(4, 8, 1025, d, generator=gen, device="cuda", dtype=dtype) for _ in range(4))
    runs = []
    for _ in range(2):
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attention(*ins, causal=causal, window=window, impl="triton", deterministic=True)
        runs.append(torch.autograd.grad(out, ins, do))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("mask", ["causal", "band"])
@pytest.mark.parametrize("d", [64, 128])
def test_fused_qkv_gradient_on_gpu(d, mask):
    """q, k, v as slices of one projection: dQ, dK, dV written into one (B, T, H, 3, D) gradient."""
    causal, window = CUDA_MASKS[mask]
    errs, _, _ = packed_errors_vs_float64(2, 333, 3, d, causal, window, "triton", torch.bfloat16, device="cuda")
    assert max(errs) < TOLERANCE[torch.bfloat16], f"(O, dQKV) relative errors {errs}"


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
def test_float32_goes_to_sdpa_and_the_kernel_refuses_it():
    """The kernel takes half precision on a GPU; "auto" sends float32 to PyTorch's SDPA, exactly."""
    errs = errors_vs_float64((1, 2, 300, 80), True, None, "auto", dtype=torch.float32, device="cuda")
    assert max(errs) < 1e-3, f"(O, dQ, dK, dV) relative errors {errs}"  # float32 SDPA may use 3×TF32 matmuls
    q = torch.randn(1, 1, 8, 64, device="cuda")
    from model.attention import attention

    with pytest.raises(ValueError, match="float32"):
        attention(q, q, q, impl="triton")


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
    """B·H above 65,535 (CUDA's limit on grid axes 1 and 2; B·H is on axis 0) launches and stays exact."""
    errs = errors_vs_float64((1, 70_000, 17, 64), True, None, "triton", dtype=torch.bfloat16, device="cuda")
    assert max(errs) < TOLERANCE[torch.bfloat16], errs


def test_every_tuning_config_matches_float64(monkeypatch):
    """Each config of FWD_TUNING, BWD_TUNING and DQ_TUNING and of TABLE, forced one at a time, at a
    head dim it serves (64 for the 64 lists, 128 for the 128 lists: the most registers), causal and
    banded, bf16, with both backwards."""
    from model import attention_configs as ac
    from model import attention_triton as at

    def entries(name, d):
        return list(dict.fromkeys([*ac.candidates(ac.KERNELS[name][0], d), *ac.table_entries(name, d)]))

    failures = []
    for d in (64, 128):
        fwds, bwds, dqs = entries("forward", d), entries("backward", d), entries("backward_dq", d)
        for i in range(max(len(fwds), len(bwds), len(dqs))):
            fwd, bwd, dq = fwds[min(i, len(fwds) - 1)], bwds[min(i, len(bwds) - 1)], dqs[min(i, len(dqs) - 1)]
            monkeypatch.setattr(at._fwd_kernel, "configs", at.triton_configs([fwd], "MASK_N"))
            monkeypatch.setattr(at._bwd_kernel, "configs", at.triton_configs([bwd], "MASK_M"))
            monkeypatch.setattr(at._bwd_kv_kernel, "configs", at.triton_configs([bwd], "MASK_M"))
            monkeypatch.setattr(at._bwd_dq_kernel, "configs", at.triton_configs([dq], "MASK_N"))
            for causal, window in ((True, None), (True, 256), (False, 37)):
                for deterministic in (False, True):
                    errs = errors_vs_float64((2, 3, 1000, d), causal, window, "triton", torch.bfloat16, seed=i,
                                             device="cuda", deterministic=deterministic)
                    if max(errs) >= TOLERANCE[torch.bfloat16]:
                        failures.append(f"forward {fwd} backward {bwd} dQ pass {dq} deterministic={deterministic} "
                                        f"d={d} causal={causal} window={window}: {errs}")
    assert not failures, "\n".join(failures)


AUTOTUNE_SCRIPT = """
import json, torch
from attention_reference import errors_vs_float64
from model import attention_triton as at
assert at.AUTOTUNE
errors = [errors_vs_float64((2, 4, t, 128), True, window, "triton", torch.bfloat16, seed=t, device="cuda")
          for t, window in ((1000, None), (600, None), (900, 256))]
print(json.dumps({"errors": errors,
                  "forward_keys": len(at._fwd_kernel.cache), "backward_keys": len(at._bwd_kernel.cache),
                  "configs_timed": len(at._bwd_kernel.configs_timings)}))
"""


def test_full_autotune_in_a_fresh_process():
    """The autotuner benchmarks every config once per (T bucket, band width, head dim, dtype): T=1000
    and T=600 (both in the 1024 bucket, dense causal) share one tuned choice; window 256 adds one."""
    env = {**os.environ, "GPT3D_TRITON_AUTOTUNE": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}"}
    proc = subprocess.run([sys.executable, "-c", AUTOTUNE_SCRIPT], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert all(max(errs) < TOLERANCE[torch.bfloat16] for errs in result["errors"]), result
    assert result["forward_keys"] == result["backward_keys"] == 2, result
    assert result["configs_timed"] > 1, result
