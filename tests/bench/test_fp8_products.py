"""bench.fp8_products on a CPU at toy sizes: the sweep times every product of the case's linears and head once,
and writes the table the fp8 rule reads; a budget that runs out writes what was measured, marked partial."""

from __future__ import annotations

import io
import json

import pytest

from bench.fp8_products import main
from model import GPTConfig
from train.planner.fp8_rule import choose_fp8_linears, load_table

# the toy model (configs/model/toy.yaml: d_model 128, d_ff 512) at tp=2, micro batch 1 of 16 tokens: each rank's
# (in, out) of attn.qkv, attn.proj, mlp.fc and mlp.proj (the head's 128 × 25216 left out: slow on a CPU)
SHARDS = [(128, 192), (64, 128), (128, 256), (256, 128)]


def test_a_cpu_sweep_writes_the_table_the_rule_reads(tmp_path):
    out = tmp_path / "table.json"
    text = io.StringIO()
    assert main(["--device", "cpu", "--cases", "toy:2:1", "--seq-len", "16", "--out", str(out), "--iterations", "1",
                 "--warmup", "0", "--no-head"], text) == 0
    expected = []
    for k, n in SHARDS:  # forward (N·k·n), input grad (N·n·k), weight grad (n·N·k), each shape once
        expected += [shape for shape in [(16, k, n), (16, n, k), (n, 16, k)] if shape not in expected]
    table = load_table(out)
    assert [(r.m, r.k, r.n) for r in table.rows] == expected
    assert table.gpu == "CPU" and not json.loads(out.read_text())["partial"]
    assert f"wrote {out}: {len(expected)} of {len(expected)} shapes" in text.getvalue()
    config = GPTConfig(name="toy", n_layer=4, n_head=4, d_model=128, seq_len=16)
    choice = choose_fp8_linears(config, 2, 1, "tensorwise", table=table)
    rows = {(r.m, r.k, r.n): r for r in table.rows}
    for verdict, (k, n) in zip(choice.verdicts, SHARDS):  # each product measured at its own shape
        products = [rows[s] for s in [(16, k, n), (16, n, k), (n, 16, k)]]
        by_hand = sum(r.mm_s for r in products) / sum(sum(r.fp8["tensorwise"]) for r in products)
        assert verdict.speedup == pytest.approx(by_hand)
    assert choice.basis.startswith("by the table measured on CPU")


def test_a_budget_that_runs_out_writes_a_partial_table(tmp_path):
    out = tmp_path / "table.json"
    text = io.StringIO()
    assert main(["--device", "cpu", "--cases", "toy:1:1", "--seq-len", "16", "--out", str(out), "--budget-s", "1e-9"],
                text) == 0
    assert json.loads(out.read_text())["partial"] and load_table(out).rows == ()
    assert "the budget ran out: partial" in text.getvalue()
