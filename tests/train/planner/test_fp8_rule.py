"""train/planner/fp8_rule.py: which block linears compute in float8, by their product shapes after sharding.

References, never the rule's own output: without a measured table, torchao's own float8 filter
(torchao.float8._auto_filter_for_recipe) on an nn.Linear of the shard's shape, and at 125M, 1.3B and 175B
tp=8 the linears written out here from torchao's thresholds; with a table, a table written by hand here
whose speeds make the answer plain (each linear's three products at one speed: the linear's predicted speed
is that speed). The planner's step time with one linear in float8 against bf16's is worked out by hand from
its model (twice the GEMM rate, the casts' bytes) as tests/train/planner/test_plan_precision.py does for all four.
"""

from __future__ import annotations

import json

import pytest
import torch

import model.float8_library  # noqa: F401  (torchao imported without its import-time noise)
from model import GPTConfig
from model.modes import BLOCK_LINEARS
from train.config.sections.train import FP8_LINEARS, TrainConfig
from train.config.settings import ConfigError
from train.planner.estimate import Layout, build_plan, for_precision
from train.planner.fp8_rule import MIN_SPEEDUP, choose_fp8_linears, linear_shapes, load_table, table_from_json
from train.planner.hardware import preset

SIZES = {  # GPT-3's Table 2.1 (configs/model/)
    "gpt3-125m": dict(n_layer=12, n_head=12, d_model=768),
    "gpt3-350m": dict(n_layer=24, n_head=16, d_model=1024),
    "gpt3-1.3b": dict(n_layer=24, n_head=16, d_model=2048),
    "gpt3-175b": dict(n_layer=96, n_head=96, d_model=12288),
}


def gpt3(name: str) -> GPTConfig:
    return GPTConfig(name=name, seq_len=2048, **SIZES[name])


# torchao's thresholds, worked out by hand for W (out, in) of each shard (tensorwise: fp8 unless in ≤ 4096 and
# out ≤ 1024; rowwise: unless out ≤ 2048, in ≤ 1024, or out ≤ 4096 and in ≤ 2048)
BY_HAND = {
    ("gpt3-125m", 1, "tensorwise"): {"attn.qkv", "mlp.fc"},  # outs 2304 and 3072; attn.proj 768, mlp.proj 768
    ("gpt3-125m", 1, "rowwise"): set(),  # every in is 768 but mlp.proj's 3072, whose out is 768
    ("gpt3-350m", 1, "tensorwise"): {"attn.qkv", "mlp.fc"},  # attn.proj 1024 × 1024, mlp.proj out 1024
    ("gpt3-350m", 1, "rowwise"): set(),  # ins of 1024, and mlp.proj's out 1024
    ("gpt3-1.3b", 1, "tensorwise"): set(BLOCK_LINEARS),  # every out > 1024
    ("gpt3-1.3b", 1, "rowwise"): {"attn.qkv", "mlp.fc"},  # attn.proj and mlp.proj: out 2048
    ("gpt3-175b", 8, "tensorwise"): set(BLOCK_LINEARS),
    ("gpt3-175b", 8, "rowwise"): set(BLOCK_LINEARS),  # smallest: attn.proj in 1536, out 12288
}


@pytest.mark.parametrize("size, tp, recipe", list(BY_HAND), ids=[f"{s}-tp{t}-{r}" for s, t, r in BY_HAND])
def test_without_a_table_the_rule_is_torchaos_filter_on_the_shards(size, tp, recipe):
    from torchao.float8 import _auto_filter_for_recipe

    config = gpt3(size)
    choice = choose_fp8_linears(config, tp, 1, recipe)
    assert set(choice.linears) == BY_HAND[size, tp, recipe]
    shapes = {"attn.qkv": (config.d_model, 3 * config.d_model // tp), "attn.proj": (config.d_model // tp, config.d_model),
              "mlp.fc": (config.d_model, config.d_ff // tp), "mlp.proj": (config.d_ff // tp, config.d_model)}
    keeps = _auto_filter_for_recipe(recipe, [])
    with torch.device("meta"):
        torchao = {name for name, (k, n) in shapes.items() if keeps(torch.nn.Linear(k, n), name)}
    assert set(choice.linears) == torchao
    assert not choice.head.fp8  # the head stays bf16, whatever the rule says of it
    # the head's vocabulary-parallel rows: 50257 padded to a multiple of 128·tp, a rank's 1/tp
    assert choice.verdicts[-1].name == "head" and choice.head.out_features == {1: 50304, 8: 51200 // 8}[tp]


def test_the_run_line_and_record_at_125m():
    choice = choose_fp8_linears(gpt3("gpt3-125m"), 1, 8, "tensorwise", preset="h200")
    assert choice.line() == ("fp8 tensorwise: 24 of 48 block linears in float8 (attn.qkv, mlp.fc; attn.proj, mlp.proj "
                             "in bf16), head in bf16, by torchao's thresholds (no measured table "
                             "configs/plan/fp8/h200.json yet)")
    record = choice.to_json()
    assert record["block_linears_fp8"] == 24 and record["block_linears"] == 48 and record["head"] == "bf16"
    assert record["shapes"]["attn.qkv"] == {"tokens": 16384, "in": 768, "out": 2304, "fp8": True, "rule": "fp8",
                                            "predicted_speedup": None}
    none = choose_fp8_linears(gpt3("gpt3-125m"), 1, 8, "rowwise")
    assert none.line().startswith("fp8 rowwise: 0 of 48 block linears in float8 (none: every product computes as in "
                                  "bf16), head in bf16, by torchao's thresholds (no GPU here")


def test_the_setting_overrides_the_rule_and_bad_values_are_one_line():
    config = gpt3("gpt3-125m")
    assert choose_fp8_linears(config, 1, 8, "rowwise", "all").linears == BLOCK_LINEARS
    chosen = choose_fp8_linears(config, 1, 8, "rowwise", ["mlp.proj", "attn.qkv"])
    assert chosen.linears == ("attn.qkv", "mlp.proj") and "as train.fp8_linears=[mlp.proj,attn.qkv] says" in chosen.line()
    assert tuple(FP8_LINEARS) == BLOCK_LINEARS  # the setting's names are the model's
    assert TrainConfig(fp8_linears=["mlp.fc"]).fp8_linears == ["mlp.fc"]
    for bad in (["mlp.gate"], ["mlp.fc", "mlp.fc"], "some", ["head"]):
        with pytest.raises(ConfigError) as refused:
            TrainConfig(fp8_linears=bad)
        assert str(refused.value) == (f"train.fp8_linears={bad!r}: must be auto, all, or a list of distinct block "
                                      f"linears from {list(BLOCK_LINEARS)}, e.g. [mlp.fc,mlp.proj]")


RATE = 500e12  # the hand-written table's bf16 FLOP/s


def row(m: int, k: int, n: int, speed: float) -> dict:
    """A measured product whose float8 version (casts 30%, _scaled_mm 70%) runs `speed` times as fast as bf16's."""
    mm = 2 * m * k * n / RATE
    return {"m": m, "k": k, "n": n, "mm_s": mm, "tensorwise": {"scaled_mm_s": 0.7 * mm / speed, "casts_s": 0.3 * mm / speed}}


# 1.3B's shapes (d 2048, d_ff 8192) at micro batch 1 (2048 tokens): every product of every linear and the head,
# at speeds that make each linear's answer plain; qkv's products also at micro batch 8 (16384 tokens)
TABLE = {"preset": "test-gpu", "gpu": "Test GPU", "commit": "abc1234", "date": "2026-12-01", "products": [
    *(row(*s, 1.04) for s in [(2048, 2048, 6144), (2048, 6144, 2048), (6144, 2048, 2048)]),  # qkv: just below 1.05
    row(2048, 2048, 2048, 0.8),  # attn.proj: all three products are this shape, slower in float8
    *(row(*s, 1.5) for s in [(2048, 2048, 8192), (2048, 8192, 2048), (8192, 2048, 2048)]),  # mlp.fc and mlp.proj
    *(row(*s, 2.0) for s in [(2048, 2048, 50304), (2048, 50304, 2048), (50304, 2048, 2048)]),  # the head
    *(row(*s, 1.3) for s in [(16384, 2048, 6144), (16384, 6144, 2048), (6144, 16384, 2048)]),  # qkv, 16384 tokens
]}


def test_with_a_measured_table_a_linear_is_float8_where_its_three_products_are_faster(tmp_path):
    path = tmp_path / "test-gpu.json"
    path.write_text(json.dumps(TABLE))
    table, config = load_table(path), gpt3("gpt3-1.3b")
    choice = choose_fp8_linears(config, 1, 1, "tensorwise", table=table)
    speeds = {v.name: v.speedup for v in choice.verdicts}
    assert speeds == pytest.approx({"attn.qkv": 1.04, "attn.proj": 0.8, "mlp.fc": 1.5, "mlp.proj": 1.5, "head": 2.0})
    assert choice.linears == ("mlp.fc", "mlp.proj") and MIN_SPEEDUP == 1.05
    assert choice.head.rule and not choice.head.fp8  # it would pay; it stays bf16
    assert choice.line().endswith(f"by the table measured on Test GPU (abc1234, 2026-12-01), {path}")
    eight = choose_fp8_linears(config, 1, 8, "tensorwise", table=table)  # qkv's products measured at 16384 tokens
    assert eight.verdicts[0].speedup == pytest.approx(1.3) and "attn.qkv" in eight.linears
    rowwise = choose_fp8_linears(config, 1, 1, "rowwise", table=table)  # no rowwise rows: torchao's thresholds
    assert set(rowwise.linears) == BY_HAND["gpt3-1.3b", 1, "rowwise"]
    assert rowwise.line().endswith(f"by torchao's thresholds ({path} has no rowwise rows)")


@pytest.mark.parametrize("entry, message", [
    ({"m": 16, "k": 16, "n": 16, "mm_s": -1.0}, "products[0].mm_s=-1.0: must be a positive number of seconds"),
    ({"m": 16, "k": 0, "n": 16, "mm_s": 1.0}, "products[0].k=0: must be a positive integer"),
    ({"m": 16, "k": 16, "n": 16, "mm_s": 1.0, "rowwise": {"casts_s": 1.0}},
     "products[0].rowwise.scaled_mm_s=None: must be a positive number of seconds"),
], ids=["seconds", "shape", "recipe"])
def test_a_malformed_table_is_one_line_naming_the_file_and_entry(tmp_path, entry, message):
    with pytest.raises(ValueError) as refused:
        table_from_json({"products": [entry]}, "configs/plan/fp8/x.json")
    assert str(refused.value) == f"configs/plan/fp8/x.json: {message}"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json: not a readable JSON table of float8 products"):
        load_table(tmp_path / "bad.json")


def test_the_planner_times_only_the_chosen_linears_in_float8(monkeypatch, tmp_path):
    """1.3B, one layout, compiled: mlp.fc alone in float8 changes the step by its three products at twice the
    rate and their casts (8 bytes per element of x, W and g: each operand's amax, 2, and its two casts, 3 each), 24 blocks; auto plans the rule's choice (here
    by torchao's thresholds: no table in the folder the rule reads)."""
    monkeypatch.setattr("train.planner.fp8_rule.TABLE_DIR", tmp_path)
    cfg, hw, layout = gpt3("gpt3-1.3b"), preset("h100-80g"), Layout(1, 1, 1, 4, 4)
    bf16 = build_plan(cfg, layout, hw, implementation=for_precision("bf16", compiled=True))
    fc = build_plan(cfg, layout, hw, implementation=for_precision("fp8", compiled=True, fp8_linears=["mlp.fc"]))
    n, k, m = 4 * 2048, 2048, 8192
    change = 8 * (n * k + k * m + n * m) / hw.memory_bandwidth - 3 * n * k * m / hw.flops
    assert fc.ranks[0].time["compute_s"] - bf16.ranks[0].time["compute_s"] == pytest.approx(24 * change, rel=1e-9)
    by_rule = build_plan(cfg, layout, hw, implementation=for_precision("fp8", fp8_recipe="rowwise", compiled=True,
                                                                      fp8_linears="auto"))
    chosen = build_plan(cfg, layout, hw, implementation=for_precision("fp8", fp8_recipe="rowwise", compiled=True,
                                                                      fp8_linears=["attn.qkv", "mlp.fc"]))
    assert by_rule.step_time_s == chosen.step_time_s


def test_shapes_after_sharding():
    assert linear_shapes(gpt3("gpt3-175b"), 8) == {"attn.qkv": (12288, 4608), "attn.proj": (1536, 12288),
                                                   "mlp.fc": (12288, 6144), "mlp.proj": (6144, 12288),
                                                   "head": (12288, 51200 // 8)}  # 50257 → 50 · 128 · 8 rows
