"""Benchmarks run in CI in their quick modes: each prints its table with baseline rows and ratios.

These check that the benchmarks work, not how fast anything is: figures come from `bench/`
runs on real hardware, never from a test.
"""

import os
import re
from pathlib import Path

import pytest
from cli import run_module

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> str:
    proc = run_module(args[0], list(args[1:]), env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_attention_benchmark_quick_prints_ratios_against_its_baseline():
    out = run_bench("bench.attention", "--quick", "--threads", "1")
    rows = [line for line in out.splitlines() if line.startswith("T=")]
    baselines = [r for r in rows if "reference *" in r]
    assert len(baselines) == 1, out  # the quick run's one sequence length
    for row in baselines:
        speed, mem = row.split()[-2:]
        assert (float(speed), float(mem)) == (1.0, 1.0)  # the baseline against itself
    assert any(" torch " in r for r in rows) and any("w=256" in r for r in rows), out


def test_pipeline_bubble_benchmark_quick_measures_every_schedule_beside_its_prediction(tmp_path):
    """Each schedule's measured bubble against the prediction of parallel.schedules (V=2 for the interleaved
    schedule, a chunk doing half a rank's work): never below it, and the zero-bubble schedules below 1F1B
    where the predictions lie far apart (pp=4: 0.200 and 0.111 against 0.429)."""
    import json

    from parallel.schedules.orders import Costs, placement_of, predicted_bubble

    schedules = ("1f1b", "zb-h1", "interleaved", "zb-v")
    out = run_bench("bench.pipeline_bubble", "--quick", "--results", str(tmp_path))
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in schedules]
    assert [(r[0], int(r[1]), int(r[2])) for r in rows] == [
        (schedule, pp, 4) for pp in (2, 4) for schedule in schedules], out
    measured = {}
    for schedule, pp, m, predicted, bubble, *rest in rows:
        pp, m = int(pp), int(m)
        placement = placement_of(schedule, pp, 2)
        chunk = Costs(*(20 / placement.virtual,) * 3)
        assert float(predicted) == round(predicted_bubble(schedule, placement, m, chunk), 3)
        # a real pipeline can only do worse than the ideal schedule, and sleeping stages keep it close
        assert float(predicted) - 0.01 <= float(bubble) < float(predicted) + 0.35, out
        measured[schedule, pp] = float(bubble)
        assert len(rest) == (4 if schedule == "1f1b" else 5), out  # vs 1f1b on gpt3d's schedules only
    assert measured["zb-h1", 4] < measured["1f1b", 4] and measured["zb-v", 4] < measured["1f1b", 4], out
    (json_file,) = tmp_path.glob("pipeline_bubble-CPU-*.json")
    records = json.loads(json_file.read_text())
    assert [(r["schedule"], r["pp"]) for r in records] == [(s, pp) for pp in (2, 4) for s in schedules]
    assert all(r["device"] == "CPU (gloo, sleeping stages)" and r["command"].endswith(str(tmp_path)) for r in records)
    (markdown,) = tmp_path.glob("pipeline_bubble-CPU-*.md")
    assert all(" ".join(r) in " ".join(markdown.read_text().split()) for r in rows)


def test_pipeline_memory_benchmark_quick_measures_each_stage_under_both_schedules(tmp_path):
    """The real pipeline at pp=2, m=4: each stage's activation peak under 1F1B and ZB-H1, from profiles that
    account for every byte the passes allocate (the memory is back at the step's start before the optimizer)."""
    import json

    out = run_bench("bench.pipeline_memory", "--quick", "--results", str(tmp_path))
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip().split()[:1] in (["0"], ["1"], ["max"])}
    assert set(rows) == {"0", "1", "max"}, out
    one = [float(rows[s][1]) for s in "01"]
    zb = [float(rows[s][3]) for s in "01"]
    assert one[0] > one[1] > 0 and min(zb) > 0, out  # under 1F1B stage 0 holds the most micro batches
    assert float(rows["max"][1]) == max(one) and float(rows["max"][2]) == max(zb), out
    # the ratio of the unrounded peaks, printed to 3 decimals beside peaks printed to 2
    assert float(rows["max"][3]) == pytest.approx(max(zb) / max(one), abs=2e-3), out
    assert rows["0"][2].startswith("BackwardPass(") and rows["0"][4].startswith(("InputGradPass(", "WeightGradPass")), out
    assert float(rows["0"][5]) == pytest.approx(zb[0] / one[0], abs=2e-3), out
    (check,) = [line for line in out.splitlines() if "back at the step's start" in line]
    assert int(check.split("to within ")[1].split()[0]) <= 64, out
    (json_file,) = tmp_path.glob("pipeline_memory-CPU-*.json")
    (record,) = json.loads(json_file.read_text())
    assert (record["pp"], record["m"], len(record["stages"])) == (2, 4, 2)
    assert record["max_ratio"] == record["zb-h1_max_bytes"] / record["1f1b_max_bytes"]


@pytest.fixture(scope="module")
def train_speed(tmp_path_factory) -> tuple[str, list[dict]]:
    """bench.train_speed on the toy at T=16, micro batch 1, 2 timed steps: what it prints and its --json rows."""
    import json

    path = tmp_path_factory.mktemp("train_speed") / "rows.json"
    out = run_bench("bench.train_speed", "model=toy", "--device", "cpu", "--seq-len", "16", "--micro-batch", "1",
                    "--steps", "2", "--warmup", "0", "--json", str(path))
    return out, json.loads(path.read_text())


def test_train_speed_runs_every_row_on_the_same_batches(train_speed):
    """One model, one seed, one batch: both attentions (and the plain loss) give the same losses, step after
    step; Hugging Face's GPT-2 is the baseline row."""
    out, _ = train_speed
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in out.splitlines())
            if cells[0].startswith(("hf-gpt2 sdpa", "gpt3d attention_impl"))}
    assert set(rows) == {"hf-gpt2 sdpa *", "gpt3d attention_impl=torch", "gpt3d attention_impl=torch plain loss",
                         "gpt3d attention_impl=sdpa"}, out
    assert rows["hf-gpt2 sdpa *"][-1] == "1.00", out
    losses = {row[-2] for name, row in rows.items() if name.startswith("gpt3d")}  # "first→last"
    assert len(losses) == 1 and "→" in losses.pop(), out


def test_train_speed_json_has_every_row_with_the_engine_rows_of_the_cpus_precisions(train_speed):
    """--json writes one record per printed row: the plain rows and gpt3d's DeepSpeed step at fp32, bf16
    and fp8 (the CPU's precisions; fp8's products emulated there)."""
    out, records = train_speed
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
