"""The GPU benchmarks' code run on the CPU at toy sizes, so a GPU run has no untried path: the
attention table (checks against float64, alternating timing, failed rows printed) and the
end-to-end training table (gpt3d with each attention against Hugging Face GPT-2). Their speeds on
a CPU mean nothing; figures come from `bash bench/gpu_suite.sh` on a GPU."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args, check=True):
    # The interpreter tests set TRITON_INTERPRET=1 for the whole pytest process; the benchmark must see
    # the environment a user has, where the Triton row on a CPU is reported as failed.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_attention_smoke_checks_times_and_reports_failures():
    out = run("bench.attention", "--smoke").stdout
    causal = [line for line in out.splitlines() if line.startswith("T=128 d=64 causal")]
    by_impl = {line.split()[3]: line for line in causal}
    assert set(by_impl) == {"triton", "torch", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"}, out
    assert "FAILED" in by_impl["triton"] and "needs CUDA" in by_impl["triton"]  # printed, not dropped
    assert "FAILED" in by_impl["sdpa-cudnn"]  # no cuDNN backend on a CPU
    base = by_impl["torch"].split()
    assert base[4] == "*" and base[-2] == "1.00", out  # the baseline against itself
    flash = by_impl["sdpa-flash"].split()
    assert float(flash[-3]) < 2e-4, out  # its max relative error against float64 was checked


def test_train_speed_smoke_runs_every_row_on_the_same_batches():
    out = run("bench.train_speed", "model=toy", "--device", "cpu", "--seq-len", "32", "--micro-batch", "2",
              "--steps", "2", "--warmup", "1").stdout
    lines = {line.split()[0] + " " + line.split()[1]: line.split() for line in out.splitlines()
             if line.startswith(("hf-gpt2 sdpa", "gpt3d attention_impl"))}
    assert set(lines) == {"hf-gpt2 sdpa", "gpt3d attention_impl=torch", "gpt3d attention_impl=sdpa"}, out
    assert lines["hf-gpt2 sdpa"][2] == "*" and lines["hf-gpt2 sdpa"][-1] == "1.00", out
    # one model, one seed, one batch: the two attentions give the same loss, step after step
    assert lines["gpt3d attention_impl=torch"][-2] == lines["gpt3d attention_impl=sdpa"][-2], out


def test_train_speed_names_the_configs_for_an_unknown_model():
    proc = run("bench.train_speed", "model=gpt3-7b", "--device", "cpu", check=False)
    assert proc.returncode != 0 and "gpt3-125m" in proc.stderr and "model=gpt3-7b" in proc.stderr
