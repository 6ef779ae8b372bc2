"""The GPU benchmarks' code run on the CPU at toy sizes, so a GPU run has no untried path: the
attention table (checks against float64, alternating timing, failed rows printed) and the
end-to-end training table (gpt3d with each attention against Hugging Face GPT-2). Their speeds on
a CPU mean nothing; figures come from `bash bench/gpu_suite.sh` on a GPU."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run(*args, check=True, env_extra=None):
    # The interpreter tests set TRITON_INTERPRET=1 for the whole pytest process; the benchmark must see
    # the environment a user has, where the Triton row on a CPU is reported as failed, unless a test
    # sets it on purpose (env_extra).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env_extra or {})
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_attention_smoke_checks_times_and_reports_failures():
    out = run("bench.attention", "--smoke").stdout
    causal = [line for line in out.splitlines() if line.startswith("T=128 d=64 causal")]
    by_impl = {line.split()[3]: line for line in causal}
    assert set(by_impl) == {"triton", "triton-det", "torch", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"}, out
    for impl in ("triton", "triton-det"):
        assert "FAILED" in by_impl[impl] and "needs CUDA" in by_impl[impl]  # printed, not dropped
    assert "FAILED" in by_impl["sdpa-cudnn"]  # no cuDNN backend on a CPU
    base = by_impl["torch"].split()
    assert base[4] == "*" and base[-2] == "1.00", out  # the baseline against itself
    flash = by_impl["sdpa-flash"].split()
    assert float(flash[-3]) < 2e-4, out  # its max relative error against float64 was checked


# A stand-in for flash-attn's flash_attn_func with its documented contract: (B, T, H, D) tensors; query
# i sees key j iff i − left ≤ j ≤ i + right for window_size=(left, right) (−1: no limit), and j ≤ i
# when causal. It lets the benchmark's flash-attn rows run on a CPU: a wrong layout or window in the
# benchmark's call shows up as their error against float64.
FAKE_FLASH_ATTN = textwrap.dedent("""
    import math
    import torch

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        deterministic=False):
        t = q.shape[1]
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        left, right = window_size
        visible = (j <= i) if causal else torch.ones(t, t, dtype=torch.bool)
        if left >= 0:
            visible = visible & (j >= i - left)
        if right >= 0:
            visible = visible & (j <= i + right)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        scores = q @ k.transpose(-2, -1) * (softmax_scale or 1 / math.sqrt(q.shape[-1]))
        return (torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v).transpose(1, 2)
""")


def test_attention_smoke_json_has_every_row_and_runs_the_kernel_rows_interpreted(tmp_path):
    """--json writes one record per printed row. With TRITON_INTERPRET=1 the triton and triton-det rows
    run (checked against float64 inside the benchmark), and the flash-attn rows appear when it imports."""
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(FAKE_FLASH_ATTN)
    path = tmp_path / "rows.json"
    out = run("bench.attention", "--smoke", "--json", str(path),
              env_extra={"TRITON_INTERPRET": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}).stdout
    records = json.loads(path.read_text())
    printed = [line for line in out.splitlines() if line.startswith("T=128 d=64 ")]
    assert len(records) == len(printed), out
    by_name = {(r["case"], r["implementation"]): r for r in records}
    causal, window = "T=128 d=64 causal", "T=128 d=64 window 32"
    assert set(by_name) == {(causal, name) for name in ("triton", "triton-det", "torch", "flash-attn", "flash-attn-det",
                                                        "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")} | \
        {(window, name) for name in ("torch w=32", "flex w=32", "flash-attn w=32", "flash-attn-det w=32",
                                     "sdpa-efficient w=32")}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    for (case, name), r in by_name.items():
        assert r["device"] == "CPU" and r["commit"] == commit and r["dtype"] == "float32", r
        assert (r["batch"], r["heads"], r["T"], r["head_dim"], r["causal"]) == (1, 2, 128, 64, True), r
        assert r["window"] == (32 if case == window else None), r
        assert r["baseline"] == ("torch" if case == causal else "torch w=32"), r
        if r["error"] is None:
            assert r["err"] < 2e-4 and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_tflops"] > 0, r
            assert r["speed_vs_baseline"] > 0 and r["peak_mib"] is None, r  # no CUDA memory figures on a CPU
        else:
            assert r["fwd_ms"] is None and r["speed_vs_baseline"] is None, r
    for name in ("triton", "triton-det", "flash-attn", "flash-attn-det"):
        assert by_name[causal, name]["error"] is None, by_name[causal, name]
    for name in ("flash-attn w=32", "flash-attn-det w=32"):
        assert by_name[window, name]["error"] is None, by_name[window, name]
    base = by_name[causal, "torch"]
    assert base["is_baseline"] and base["speed_vs_baseline"] == 1.0
    assert by_name[causal, "sdpa-cudnn"]["error"]  # a failed row is kept, with its reason
    assert "backward on CPU" in by_name[window, "flex w=32"]["error"]  # FlexAttention differentiates on GPUs only


def test_banded_gpu_table_is_the_window_cases_against_flex_attention():
    from bench.attention import gpu_cases

    banded = gpu_cases(quick=False, flash_attn=True, banded=True)
    assert [name for name, *_ in banded] == [f"T={t} d={d} window 256" for t, dims in ((2048, (64, 80, 96, 128)),
                                                                                        (8192, (64, 128))) for d in dims]
    for _, _, rows, baseline in banded:
        assert baseline == "flex w=256" and ("flex w=256", "flex", 256) in rows and ("flash-attn w=256", "flash-attn", 256) in rows
    assert all(("flex" not in [impl for _, impl, _ in rows]) for *_, rows, _ in gpu_cases(quick=False, flash_attn=True))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_rows_mask_the_band_as_the_reference_does():
    """The FlexAttention rows' block mask (causal, and a sliding window) against float64, forward only:
    FlexAttention has no backward on a CPU, where the smoke run reports its row as failed."""
    from attention_reference import float64_attention, rel_err
    from bench.attention import flex_fn

    q, k, v = torch.randn(3, 1, 2, 100, 64, generator=torch.Generator().manual_seed(0)).unbind(0)  # each (B, H, T, D)
    for window in (32, None):
        ref = float64_attention(q.double(), k.double(), v.double(), True, window)
        assert rel_err(flex_fn(window)(q, k, v), ref) < 2e-4, window


def test_train_speed_names_the_configs_for_an_unknown_model():
    proc = run("bench.train_speed", "model=gpt3-7b", "--device", "cpu", check=False)
    assert proc.returncode != 0 and "gpt3-125m" in proc.stderr and "model=gpt3-7b" in proc.stderr


def test_attention_sweep_lists_its_cases_and_its_smoke_run_times_them(tmp_path):
    """The GPU sweep's code on the CPU: --list prints every (kernel, configuration, head dim, shape) of
    SWEEP in timing order, each TABLE choice among them; --smoke runs two configurations per kernel
    through the interpreter and writes one record per case, each as soon as it is timed."""
    from model.attention_configs import TABLE, sweep_at

    listed = [json.loads(line) for line in run("bench.attention_sweep", "--list").stdout.splitlines()]
    assert len(listed) == 3 * sum(len(sweep_at(kernel, d)) for kernel in TABLE for d in (64, 80, 96, 128))
    assert (listed[0]["T"], listed[0]["window"], listed[0]["head_dim"], listed[0]["kernel"]) == (2048, None, 128, "forward")
    chosen = {(c["kernel"], c["head_dim"], c["T"], c["window"]) for c in listed if c["in_table"]}
    shapes = {(c["T"], c["window"]) for c in listed}
    assert chosen == {(kernel, d, t, w) for kernel in TABLE for d in TABLE[kernel] for t, w in shapes}  # TABLE ⊂ SWEEP
    path = tmp_path / "sweep.json"
    out = run("bench.attention_sweep", "--smoke", "--json", str(path)).stdout
    records = json.loads(path.read_text())
    assert len(records) == 8 and {r["kernel"] for r in records} == set(TABLE), out
    for r in records:
        assert r["error"] is None and r["ms"] > 0 and r["tflops"] > 0 and r["device"] == "CPU", r
        assert (r["head_dim"], r["T"], r["batch"], r["heads"], r["dtype"]) == (64, 64, 1, 2, "float16"), r
