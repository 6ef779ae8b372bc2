"""Benchmarks run in CI in their quick modes: each prints its table with baseline rows and ratios.

These check that the benchmarks work, not how fast anything is: figures come from `bench/`
runs on real hardware, never from a test.
"""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_attention_benchmark_quick_prints_ratios_against_its_baseline():
    out = run_bench("bench.attention", "--quick", "--threads", "1")
    rows = [line for line in out.splitlines() if line.startswith("T=")]
    baselines = [r for r in rows if "reference *" in r]
    assert len(baselines) == 2, out  # one baseline per sequence length
    for row in baselines:
        speed, mem = row.split()[-2:]
        assert (float(speed), float(mem)) == (1.0, 1.0)  # the baseline against itself
    assert any(" torch " in r for r in rows) and any("w=256" in r for r in rows), out


def test_pipeline_bubble_benchmark_quick_measures_each_case_beside_the_1f1b_prediction():
    out = run_bench("bench.pipeline_bubble", "--quick")
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert {(int(r[0]), int(r[1])) for r in rows} == {(2, 1), (2, 4), (4, 1), (4, 4)}, out
    for pp, m, predicted, measured, *_ in rows:
        pp, m = int(pp), int(m)
        assert float(predicted) == round((pp - 1) / (m + pp - 1), 3)
        # a real pipeline can only do worse than the ideal schedule, and sleeping stages keep it close
        assert float(predicted) - 0.01 <= float(measured) < float(predicted) + 0.3, out


def test_train_speed_json_has_every_row_with_the_engine_rows_of_the_cpus_precisions(tmp_path):
    """--json writes one record per printed row: the plain rows and gpt3d's DeepSpeed step at fp32, bf16
    and fp8 (the CPU's precisions; fp8's products emulated there)."""
    import json

    path = tmp_path / "rows.json"
    out = run_bench("bench.train_speed", "model=toy", "--device", "cpu", "--seq-len", "16", "--micro-batch", "1",
                    "--steps", "1", "--warmup", "0", "--json", str(path))
    records = json.loads(path.read_text())
    expected = ["hf-gpt2 sdpa", "gpt3d attention_impl=torch", "gpt3d attention_impl=torch plain loss",
                "gpt3d attention_impl=sdpa",
                "gpt3d deepspeed precision=fp32", "gpt3d deepspeed precision=bf16", "gpt3d deepspeed precision=fp8"]
    assert [r["row"] for r in records] == expected
    fields = {"model", "row", "step_ms", "tokens_per_s", "mfu", "peak_gib", "gpu", "commit", "micro_batch", "seq_len",
              "alternated", "error"}
    for record in records:
        assert set(record) == fields and record["model"] == "toy" and record["gpu"] == "CPU"
        assert record["peak_gib"] is None and record["mfu"] is None  # no GPU: no memory peak, no MFU
        assert record["alternated"] == (not record["row"].startswith("gpt3d deepspeed"))  # toy rows fit together
        assert record["error"] is None, record
        assert record["tokens_per_s"] == pytest.approx(16 / (record["step_ms"] / 1e3))  # micro batch 1 × T=16
        assert any(line.startswith(record["row"]) and f"{record['step_ms']:.1f}" in line for line in out.splitlines())
