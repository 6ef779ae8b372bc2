"""Benchmarks run in CI in their quick modes: each prints its table with baseline rows and ratios.

These check that the benchmarks work, not how fast anything is: figures come from `bench/`
runs on real hardware, never from a test.
"""

import subprocess
import sys
from pathlib import Path

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
