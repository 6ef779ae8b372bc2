"""bench.profile on the CPU: a real run's trace and a table whose rows account for the step's wall time."""

from __future__ import annotations

import json

import pytest

from cli import TINY, write_corpus
from distributed import run_distributed

STEPS = 3
# The table's steps span from one step's start to the next's; the loop's own clock (metrics.jsonl,
# perf/tokens_per_s) times each step from after the previous record to its own record. The two
# windows differ by the logging between them, a few ms of a step of hundreds of ms on a CPU.
WALL_RTOL = 0.2


def profile_worker(corpus: str, run_dir: str) -> dict:
    from pathlib import Path

    from bench.profile import profile

    overrides = [o for o in TINY if not o.startswith(("model.n_layer", "train.global", "train.micro"))]
    overrides += ["model.n_layer=2", "train.global_batch_size=2", "train.micro_batch_size=1", "data.streams=1",
                  "train.device=cpu", f"data.paths=[{corpus}/*.txt]"]
    return profile(overrides, Path(run_dir), STEPS, skip=1)


def test_profile_writes_a_trace_and_a_table_that_adds_up_to_the_step_time(tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    table = run_distributed(profile_worker, 1, str(corpus), str(run_dir), timeout=600)[0]

    trace = json.loads((run_dir / "profile_trace.json").read_bytes().decode("utf-8", errors="replace"))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "train_step" in names and any(str(n).startswith("aten::") for n in names)

    rows = table["rows"]
    for row in ("GEMM", "attention forward", "attention backward", "communication", "optimizer",
                "idle: in no op", "between steps: data wait, logging, checks"):
        assert row in rows, sorted(rows)
    assert rows["GEMM"] > 0 and rows["attention forward"] > 0 and rows["attention backward"] > 0
    assert rows["optimizer"] > 0 and any(k.startswith("other: aten::") for k in rows)
    assert all(v >= 0 for v in rows.values())
    assert table["steps"] == STEPS
    assert sum(rows.values()) == pytest.approx(table["total_s"], rel=1e-9)

    # the loop's own clock for the same steps (2 … STEPS + 1): tokens per step / tokens per second
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [64 / r["perf/tokens_per_s"] for r in records if 2 <= r["step"] <= STEPS + 1]
    assert len(measured) == STEPS
    wall = sum(measured) / STEPS
    assert abs(table["total_s"] - wall) <= WALL_RTOL * wall, (table["total_s"], wall)


def test_json_holds_the_printed_table_and_the_overrides(tmp_path, monkeypatch, capsys):
    """--json writes the table main() prints (what the GPU suite keeps when the trace stays in scratch)."""
    import sys

    import bench.profile as bench_profile

    table = {"rows": {"GEMM": 0.002, "attention forward": 0.001, "between steps: data wait, logging, checks": 0.0005},
             "steps": 3, "total_s": 0.0035, "device": "cpu", "trace": str(tmp_path / "run" / "profile_trace.json")}
    monkeypatch.setattr(bench_profile, "profile", lambda overrides, run_dir, steps, skip: table)
    out = tmp_path / "profile.json"
    monkeypatch.setattr(sys, "argv", ["bench.profile", "model=toy", "train.device=cpu", "--run-dir",
                                      str(tmp_path / "run"), "--json", str(out)])
    bench_profile.main()
    assert json.loads(out.read_text()) == {**table, "overrides": ["model=toy", "train.device=cpu"]}
    printed = capsys.readouterr().out
    assert "GEMM" in printed and f"{1e3 * table['total_s']:.2f}" in printed


@pytest.mark.parametrize("kernel", [
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NN",  # cuBLAS's Hopper GEMMs under torch 2.11 (H200, 2026-11-27)
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
    "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8",
])
def test_cublas_and_cutlass_kernels_count_as_gemm(kernel):
    from bench.profile import category

    assert category(kernel, ["aten::mm"]) == "GEMM"
    assert category("void at::native::vectorized_elementwise_kernel<4>", []).startswith("other:")
