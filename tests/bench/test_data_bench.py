"""bench/data.py in its quick mode: it prints the demand it assumes and, for each simulated dp, the rank's
work per global batch against dp=1 in the same run, then the Hub-style rows: the bytes a rank reads from a
folder of parquet files through data.source=hub. This checks the tables and that a rank's reading falls
about as 1/dp (reading the whole dataset on every rank would give dp times that), not any speed."""

import subprocess
import sys

import pytest

from cli import REPO


def test_data_benchmark_quick_prints_work_per_rank_against_dp1():
    proc = subprocess.run([sys.executable, "-m", "bench.data", "--quick"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("demand per rank: ") and "one H100 training gpt3-125m" in first
    demand = float(first.split()[3].replace(",", ""))
    assert 0.4e6 <= demand <= 0.5e6  # the rate the issue gives for gpt3-125m on one H100
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("4", "1", "0"), ("4", "2", "0"), ("4", "4", "0"), ("4", "1", "2"), ("4", "2", "2"), ("4", "4", "2"), ("1", "2", "0")
    ]
    for streams, dp, workers, seconds, ratio, ideal, supplies, supply_demand in rows:
        assert float(seconds) > 0 and float(supplies.replace(",", "")) > 0
        if dp == "1":
            assert ratio == "1.000"  # the baseline against itself
        assert ideal == (f"{1 / int(dp):.3f}" if streams == "4" else "-")
        supplied = float(supplies.replace(",", "")) / demand
        assert abs(float(supply_demand) - supplied) <= 0.006
    hub = [line.split() for line in proc.stdout.splitlines() if line.startswith("hub ")]
    assert [(r[1], r[2]) for r in hub] == [("4", "1"), ("4", "2"), ("4", "4")]
    for _, _, dp, megabytes, ratio, ideal, per_ideal, supplies, supply_demand in hub:
        assert float(megabytes) > 0 and float(supplies.replace(",", "")) > 0
        assert float(ideal) == 1 / int(dp) and float(per_ideal) == pytest.approx(float(ratio) * int(dp), abs=0.002)
        assert 0.7 <= float(per_ideal) <= 1.3, (dp, ratio)
