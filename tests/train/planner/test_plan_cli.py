"""`python -m train.plan` as users run it: the table, JSON, the search, the 175B dry run, bad input;
and the pre-flight check `python -m train` runs on a GPU."""

from __future__ import annotations

import io
import json
import os
import subprocess

import pytest
import torch
from cli import run_module

from model import GPT, GPTConfig, count_parameters
from parallel.naming import Shard
from train.planner.dry_run import counted, coverage
from train.planner.hardware import preset

GPT3_175B = ["model=gpt3-175b", "parallel.tp=8", "parallel.pp=16", "plan.gpus=1024"]


def plan(*overrides: str, check: bool = True, kind: str = "python") -> subprocess.CompletedProcess:
    """`python -m train.plan` as users run it (forked from the warm interpreter; `kind="process"`: a fresh one)."""
    proc = run_module("train.plan", list(overrides), kind, env=dict(os.environ), timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def plan_here(*overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    """The same command's main function in this process (no interpreter start-up per case)."""
    from train.plan import run

    out, err = io.StringIO(), io.StringIO()
    code = run(list(overrides), out, err)
    if check:
        assert code == 0, err.getvalue()[-3000:]
    return subprocess.CompletedProcess([], code, out.getvalue(), err.getvalue())


def test_175b_dry_run_builds_every_shard_and_covers_each_parameter_once():
    """The issue's command: 128 distinct shards (8 tp × 16 stages) built on meta by the project's own
    build code; the count they add up to is the meta-built full model's."""
    with torch.device("meta"):
        full = count_parameters(GPT(GPTConfig(name="gpt3-175b", n_layer=96, n_head=96, d_model=12288, seq_len=2048)))
    proc = plan(*GPT3_175B, "plan.dry_run=true")
    assert f"built all 128 distinct rank shards" in proc.stdout
    assert f"each of the {full:,} parameters exactly once" in proc.stdout


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1), (1, 1)])
def test_dry_run_of_small_layouts(tp, pp):
    """Where plain nn.Linear layers remain (tp = 1), the planner's bf16-reduced parameters are checked too:
    the tied matrix is one at pp = 1 (the unembedding is a Linear) and only on the last stage at pp > 1."""
    proc = plan("model=toy", f"parallel.tp={tp}", f"parallel.pp={pp}", f"plan.gpus={tp * pp}", "plan.dry_run=true")
    assert f"built all {tp * pp} distinct rank shards" in proc.stdout
    with torch.device("meta"):
        full = count_parameters(GPT(GPTConfig(name="toy", n_layer=4, n_head=4, d_model=128, seq_len=128)))
    assert f"each of the {full:,} parameters exactly once" in proc.stdout


def _piece(name, start, stop, dim=0, full=(10, 4)):
    """A Shard of `name` holding [start, stop) of `full` along `dim`."""
    index = [slice(0, n) for n in full]
    index[dim] = slice(start, stop)
    local = [slice(0, n) for n in full]
    local[dim] = slice(0, stop - start)
    shape = tuple(stop - start if d == dim else n for d, n in enumerate(full))
    return Shard(name, full, dim, tuple(index), tuple(local), shape)


def _whole(name, full=(10, 4), tied=False):
    return Shard(name, full, None, tuple(slice(0, n) for n in full), tuple(slice(0, n) for n in full), full, tied)


@pytest.mark.parametrize(
    "pieces, problem",
    [
        ([_piece("w", 0, 4), _piece("w", 6, 10)], "jump from 4 to 6"),  # a gap
        ([_piece("w", 0, 6), _piece("w", 4, 10)], "jump from 6 to 4"),  # an overlap
        ([_piece("w", 0, 4)], "cover 4 of 10"),  # a missing tail
        ([_piece("w", 0, 10), _piece("stray", 0, 1)], "not a parameter of the full model"),
        ([], "no shard holds it"),
        ([_whole("w"), _whole("w")], "held whole 2 times"),  # a replica counted twice
        ([_piece("w", 0, 5), _piece("w", 0, 4, dim=1)], "split along different dims"),
        ([_piece("w", 0, 5), _piece("w", 5, 10, full=(10, 3))], "not all of the other dims"),
    ],
)
def test_coverage_check_finds_gaps_overlaps_and_strays(pieces, problem):
    covered, problems = coverage(pieces, {"w": (10, 4)})
    assert any(problem in p for p in problems), problems


def test_coverage_counts_a_padded_vocabulary_once_and_each_parameter_whole():
    """Rows past the vocabulary are nobody's: 300 rows over 4 ranks of 128 leave the last rank none."""
    rows = [_piece("wte", 0, 128, full=(300, 4)), _piece("wte", 128, 256, full=(300, 4)),
            _piece("wte", 256, 300, full=(300, 4)), _piece("wte", 300, 300, full=(300, 4))]
    covered, problems = coverage(rows + [_whole("ln")], {"wte": (300, 4), "ln": (10, 4)})
    assert problems == [] and covered == 300 * 4 + 10 * 4


def test_only_tp_rank_0_counts_a_replica_and_no_rank_the_tied_copy():
    shards = {"ln": _whole("ln"), "w": _piece("w", 5, 10), "lm_head": _whole("wte", tied=True)}
    assert [s.name for s in counted(shards, tp_rank=0)] == ["ln", "w"]
    assert [s.name for s in counted(shards, tp_rank=1)] == ["w"]


def test_table_lists_first_middle_and_last_stage_and_fits_the_175b_paper_setting():
    proc = plan(*GPT3_175B, "train.global_batch_size=1536", "train.micro_batch_size=1", "parallel.zero_stage=1",
                "parallel.activation_checkpointing=1", kind="process")  # what a fresh interpreter prints
    header = next(line for line in proc.stdout.splitlines() if "first stage" in line)
    assert header.split() == ["first", "stage", "middle", "stage", "last", "stage"]
    assert "174.60B parameters" in proc.stdout and ": fits" in proc.stdout
    for row in ("Adam moments", "micro batches in flight", "tensor-parallel bytes / step", "data-parallel bytes"):
        assert row in proc.stdout
    assert "days" in proc.stdout.splitlines()[-1]
    assert "Setting accelerator" not in proc.stderr  # DeepSpeed's warning that tells a CPU user nothing


def test_json_carries_the_summary_and_the_per_rank_breakdown():
    proc = plan_here("model=gpt3-1.3b", "parallel.tp=2", "parallel.pp=2", "plan.gpus=16", "train.global_batch_size=512",
                "train.micro_batch_size=2", "plan.format=json", "plan.hardware=a100-80g")
    doc = json.loads(proc.stdout)
    for key in ("fits", "peak_memory_gib", "step_time_s", "tokens_per_s", "model_tflops_per_gpu",
                "hardware_tflops_per_gpu", "mfu", "days", "ranks"):
        assert key in doc, key
    assert doc["layout"]["dp"] == 4 and doc["hardware"]["name"] == "a100-80g"
    assert [r["stage"] for r in doc["ranks"]] == [0, 1]
    assert doc["peak_memory_gib"] == max(r["peak_memory_gib"] for r in doc["ranks"])
    # model FLOPs: 6N + 12·L·d·T per token (N without the position table), from a meta-built model
    with torch.device("meta"):
        model = GPT(GPTConfig(name="x", n_layer=24, n_head=16, d_model=2048, seq_len=2048))
    n = count_parameters(model, exclude_positions=True)
    tokens = 512 * 2048
    assert doc["model_flops_per_step"] == (6 * n + 12 * 24 * 2048 * 2048) * tokens
    assert doc["tokens_per_s"] * doc["step_time_s"] == pytest.approx(tokens)
    assert doc["mfu"] == pytest.approx(doc["model_flops_per_step"] / doc["step_time_s"] / 16 / 312e12)
    assert doc["days"] == pytest.approx(300e9 / doc["tokens_per_s"] / 86400)
    groups = {g for r in doc["ranks"] for g in r["communication_bytes_per_step"]}
    assert groups == {"tp", "pp", "dp"}


def test_search_ranks_valid_layouts_by_throughput():
    proc = plan_here("model=gpt3-1.3b", "plan.gpus=8", "train.global_batch_size=64", "plan.search=true", "plan.top=5",
                "plan.hardware=a100-40g")
    rows = [line for line in proc.stdout.splitlines() if line.strip()[:2].strip().isdigit() and "tp=" in line]
    assert len(rows) == 5
    speeds = [float(row.split()[-4].replace(",", "")) for row in rows]
    assert speeds == sorted(speeds, reverse=True)
    for row in rows:
        sizes = dict(part.split("=") for part in row.split() if "=" in part)
        assert int(sizes["tp"]) * int(sizes["pp"]) * int(sizes["dp"]) == 8
        assert float(row.split()[-2]) <= 40 - 2  # fits with the reserved headroom


def test_175b_without_a_recipe_does_not_fit_says_what_would_and_exits_1():
    """The default one GPU: the plan ends DOES NOT FIT and names the model's recipes (bf16 and fp8), each of which
    fits on its GPUs."""
    proc = plan("model=gpt3-175b", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("DOES NOT FIT; instead: no layout of gpt3-175b fits on 1 GPU(s) of h100-80g with a global "
                           "batch of 8; its recipes do: python -m train.plan +recipe="), last
    commands = last.split("recipes do: ", 1)[1].split(" or ")
    assert len(commands) == 2
    for command in commands:
        suggested = plan_here(*command.removeprefix("python -m train.plan ").split())
        assert suggested.returncode == 0 and "174.60B parameters" in suggested.stdout and ": fits" in suggested.stdout
        assert "plan.gpus=1024" in command


def test_a_layout_that_does_not_fit_names_the_fastest_that_does_on_the_same_gpus():
    batch = ("train.global_batch_size=128", "train.micro_batch_size=16")  # 16 × 2,048 tokens a micro batch: too many
    proc = plan_here("model=gpt3-1.3b", "plan.gpus=8", *batch, "plan.hardware=a100-40g", check=False)
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("DOES NOT FIT; instead: the fastest layout that fits on 8 GPU(s) of a100-40g"), last
    overrides = [word for word in last.split(": ", 2)[2].split(" (")[0].split()]
    instead = json.loads(plan_here("model=gpt3-1.3b", "plan.gpus=8", batch[0], "plan.hardware=a100-40g",
                                   "plan.format=json", *overrides).stdout)
    assert instead["fits"] and f"{instead['tokens_per_s']:,.0f} tokens/s" in last


def test_search_chooses_the_micro_batch_the_configured_one_cannot_split():
    """The default micro batch (8) does not divide the default global batch (8) over 16 GPUs at dp > 1: the search
    is not refused for it, and every layout it ranks splits the batch."""
    proc = plan_here("model=gpt3-1.3b", "plan.gpus=16", "plan.search=true", "plan.top=5")
    assert ("the configured layout is not one the trainer takes (train.global_batch_size=8 is not divisible by "
            "train.micro_batch_size=8 × data-parallel size 16); the search's fastest layout is shown") in proc.stdout
    ranked = [line for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit() and "tp=" in line]
    rows = [dict(part.split("=") for part in line.split() if "=" in part) for line in ranked]
    assert len(rows) == 5 and all(8 % (int(r["micro"]) * int(r["dp"])) == 0 for r in rows)
    shown = next(line for line in proc.stdout.splitlines() if line.startswith("layout: "))  # the plan in full
    assert shown.removeprefix("layout: ").split(" on ")[0] in ranked[0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=3", "plan.gpus=4"], "not a multiple of tp·pp = 3"),
        (["parallel.tp=3", "plan.gpus=3"], "parallel.tp=3 does not divide model.n_head=4"),
        (["parallel.pp=2", "parallel.zero_stage=2", "plan.gpus=2"], "use zero_stage 0 or 1 with pp > 1"),
        (["plan.hardware=b200"], "presets: ['a100-40g', 'a100-80g', 'h100-80g', 'h200']"),
        (["plan.device.gemm_efficiency=1.5"], "gemm_efficiency=1.5 must be at most 1"),
        (["plan.format=yaml"], "must be one of ['table', 'json']"),
        (["plan.gpus=0"], "plan.gpus=0: must be a positive integer"),
        (["plan.gpuz=3"], "plan.gpuz is not a setting; did you mean plan.gpus?"),
        (["train.micro_batch_size=3"], "not divisible by train.micro_batch_size=3"),
    ],
)
def test_bad_input_fails_with_one_clear_message(overrides, message):
    proc = plan_here(*overrides, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_hardware_figures_can_be_overridden():
    doc = json.loads(plan_here("plan.format=json", "plan.device.memory_gib=40", "plan.device.peak_tflops=100").stdout)
    assert doc["hardware"]["memory_gib"] == 40 and doc["hardware"]["peak_tflops"] == 100
    assert doc["hardware"]["sources"]["memory_gib"] == "overridden on the command line"


def test_every_preset_names_a_source_for_each_figure():
    from train.planner.hardware import FIGURES, preset_names

    assert {"a100-40g", "a100-80g", "h100-80g", "h200"} <= set(preset_names())
    for name in preset_names():
        hardware = preset(name)
        assert set(FIGURES) <= set(hardware.sources), name


def test_preflight_stops_a_layout_that_cannot_fit_and_names_three_that_do(monkeypatch):
    from omegaconf import OmegaConf

    from train.config.sections import Sections
    from train.config.settings import ConfigError
    from train.plan import compose
    from train.planner.from_config import plan_for_run, preflight
    from train.run.checks import check_model

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = compose(["model=gpt3-1.3b", "train.global_batch_size=128", "train.micro_batch_size=16"])
    sections, model_cfg = Sections.of(cfg), check_model(OmegaConf.to_container(cfg.model))
    with pytest.raises(ConfigError) as raised:
        preflight(plan_for_run(sections.train, sections.parallel, model_cfg, preset("a100-40g")))
    message = str(raised.value)
    assert "predicted peak memory" in message and "exceeds the 40.0 GiB of a100-40g" in message
    assert message.count("parallel.tp=") == 3 and "(3)" in message
    preflight(plan_for_run(sections.train, sections.parallel, model_cfg, preset("h200")))  # 140 GiB: the same run fits and pre-flight says nothing


def test_fp8_shows_which_linears_the_rule_puts_in_float8_and_the_predicted_gain(monkeypatch, tmp_path):
    """1.3B rowwise by torchao's thresholds (no table in the folder the rule reads): attn.qkv and mlp.fc. The
    gain is the bf16 plan's step over the fp8 plan's, at the same layout and compiled alike (fp8 compiles unless
    model.compile=false is given)."""
    import re

    from model.modes import BLOCK_LINEARS

    monkeypatch.setattr("train.planner.fp8_rule.TABLE_DIR", tmp_path)
    base = ["model=gpt3-1.3b", "plan.gpus=8", "train.global_batch_size=64", "train.micro_batch_size=4"]
    fp8 = plan_here(*base, "train.precision=fp8", "train.fp8_recipe=rowwise").stdout
    assert ("fp8 rowwise: 48 of 96 block linears in float8 (attn.qkv, mlp.fc; attn.proj, mlp.proj in bf16), head in "
            "bf16, by torchao's thresholds (no measured table configs/plan/fp8/h100-80g.json yet)\n") in fp8
    bf16 = plan_here(*base, "train.precision=bf16", "model.compile=true").stdout

    def step(text: str) -> float:
        return float(re.search(r"^step ([\d.]+) s \|", text, re.M).group(1))

    gain = re.search(r"predicted gain: step [\d.]+ s against [\d.]+ s in bf16 at this layout, ([\d.]+)× "
                     r"\(compiled blocks\)", fp8)
    assert gain and float(gain.group(1)) == pytest.approx(step(bf16) / step(fp8), abs=0.006)
    eager = plan_here(*base, "train.precision=fp8", "model.compile=false", "plan.format=json").stdout
    document = json.loads(eager)
    assert document["fp8"]["linears"] == list(BLOCK_LINEARS) and document["fp8"]["head"] == "bf16"  # tensorwise
    assert document["fp8"]["gain"] == pytest.approx(document["fp8"]["bf16_step_s"] / document["step_time_s"])

