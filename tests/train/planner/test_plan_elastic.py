"""parallel.layout=auto (train/planner/elastic.py, train/run/spec.py): the layout for a world size.

On a CPU, against layouts worked out by hand from the rule in docs/parallelism.md (the most data
parallelism, then tp before pp, ZeRO 0, no checkpointing, the largest micro batch; dp and data.streams
divide one another; a batch ramp's steps split over micro batch × dp). On a GPU profile: the choice
fits memory and no valid layout that fits is predicted faster (each candidate's prediction from the
planner's build_plan, the choice from elastic.py), the pipeline schedule ranked with the layouts. Through the
run specification: the chosen values are what the run follows, the caller's config is untouched, and bad
input is one ConfigError.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
from omegaconf import OmegaConf

from model import GPTConfig
from train.config.sections.parallel import AUTO_KEYS
from train.config.settings import ConfigError
from train.planner.elastic import HEADROOM_GIB, DataOrder, LayoutChoice, choose_layout
from train.planner.estimate import Layout, build_plan
from train.planner.hardware import preset
from train.planner.search import candidate_layouts
from train.planner.stage_split import balanced_blocks

TOY = GPTConfig(name="toy", n_layer=3, n_head=2, d_model=32, seq_len=32)


def shape(choice) -> tuple:
    lay = choice.layout
    return lay.tp, lay.pp, lay.dp, lay.zero_stage, lay.micro_batch, lay.checkpoint_every, lay.sequence_parallel


@pytest.mark.parametrize("processes, expected", [
    (8, (1, 1, 8, 0, 3, 0, False)),   # 24 / 8 = 3 sequences per rank
    (6, (1, 3, 2, 0, 12, 0, False)),  # dp 6 and 3 do not divide or share 4 streams; tp 3 does not divide 2 heads
    (4, (1, 1, 4, 0, 6, 0, False)),
    (3, (1, 3, 1, 0, 12, 0, False)),  # dp 3 refused by the streams: one replica of 3 stages; 16 does not divide 24
    (1, (1, 1, 1, 0, 12, 0, False)),  # the largest divisor of 24 up to 16
])
def test_cpu_rule_gives_the_hand_computed_layout(processes, expected):
    choice = choose_layout(TOY, processes, 24, DataOrder(4), None, processes)
    assert shape(choice) == expected
    assert choice.line().startswith(f"layout auto for {processes} ")
    assert choice.layout.micro_batch * choice.layout.micro_batches * choice.layout.dp == 24


def test_cpu_rule_keeps_a_batch_ramp_on_whole_micro_batches():
    # a ramp from 8 sequences: 8 must be a multiple of lcm(4 streams, micro × 8 ranks), so micro 1
    choice = choose_layout(TOY, 8, 24, DataOrder(4, (8, 8)), None, 8)
    assert shape(choice) == (1, 1, 8, 0, 1, 0, False)


def test_no_valid_layout_is_one_error_naming_the_world_sizes_that_would_do():
    # 5 = dp 1 × tp·pp 5: tp 5 does not divide 2 heads, pp 5 exceeds 3 layers; by hand for 1..10:
    # 7 and 9 and 10 fail the same way (or the streams), 1, 2, 3, 4, 6, 8 work
    with pytest.raises(ConfigError) as err:
        choose_layout(TOY, 5, 24, DataOrder(4), None, 5)
    assert "no layout of 5 processes is valid for model toy" in str(err.value)
    assert str(err.value).endswith("world sizes up to 10 that would: [1, 2, 3, 4, 6, 8]")


def gpt3_1_3b() -> GPTConfig:
    from train.config.entry import CONFIG_DIR

    return GPTConfig.from_dict(OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "gpt3-1.3b.yaml")))


def test_gpu_rule_takes_the_fastest_layout_that_fits_and_says_which_sizes_fit():
    model, small = gpt3_1_3b(), dataclasses.replace(preset("h100-80g"), memory_gib=14.0)
    choice = choose_layout(model, 4, 64, DataOrder(4), small, 4)
    plans = []
    for lay in candidate_layouts(model, 4, 64, 4):  # each with its blocks split by count, or balanced where faster
        plan = build_plan(model, lay, small, gpus_per_node=4, reserved_gib=HEADROOM_GIB)
        if balanced_blocks(plan) is not None:
            balanced = build_plan(model, dataclasses.replace(lay, stage_layers=balanced_blocks(plan)), small,
                                  gpus_per_node=4, reserved_gib=HEADROOM_GIB)
            plan = balanced if balanced.fits and balanced.tokens_per_s > plan.tokens_per_s else plan
        plans.append(plan)
    fitting = [p for p in plans if p.peak_memory_gib + HEADROOM_GIB <= 14.0 and (4 % p.layout.dp == 0 or p.layout.dp % 4 == 0)]
    assert choice.plan.peak_memory_gib + HEADROOM_GIB <= 14.0
    assert choice.plan.tokens_per_s == max(p.tokens_per_s for p in fitting)
    assert choice.layout.tp * choice.layout.pp * choice.layout.dp == 4
    assert choice.fitting == len(fitting) < choice.valid
    with pytest.raises(ConfigError) as err:  # two GPUs of 14 GiB hold no layout of 1.3B at this batch
        choose_layout(model, 2, 64, DataOrder(4), small, 2)
    assert str(err.value).endswith("world sizes up to 4 that would: [3, 4]")


def test_gpu_rule_chooses_the_pipeline_schedule_with_the_layout_and_the_run_takes_it():
    """GPT-3 1.3B on 16 H100s, batch 32: the fastest is the interleaved schedule, 3 chunks a rank on 4 ranks
    with the blocks balanced off the head's rank (test_plan_schedules.py); the choice's values are exactly
    AUTO_KEYS, and the run's sections (train/run/spec.py: replaced) take them."""
    from train.plan import load

    choice = choose_layout(gpt3_1_3b(), 16, 32, DataOrder(8), preset("h100-80g"), 8)
    values = choice.values()
    assert set(values) == set(AUTO_KEYS)
    assert choice.layout.pp == 4 and values["parallel.pipeline_schedule"] == choice.to_json()["pipeline_schedule"] == "interleaved"
    sections = load(["model=gpt3-1.3b", "train.global_batch_size=32", "parallel.layout=auto"])[0]
    assert sections.parallel.pipeline_schedule == "1f1b"
    run = sections.replaced(values)
    assert (run.parallel.pp, run.parallel.pipeline_schedule, run.parallel.virtual_stages, run.train.micro_batch_size) == \
        (4, "interleaved", 3, 2)
    assert run.parallel.stage_layers == [2, 3, 2, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    cpu = choose_layout(TOY, 6, 24, DataOrder(4), None, 6)  # pp = 3 (test_cpu_rule_gives_the_hand_computed_layout)
    assert cpu.layout.pp == 3 and cpu.values()["parallel.pipeline_schedule"] == "1f1b"


def test_a_choice_of_selective_recomputation_sets_it():
    choice = LayoutChoice(Layout(1, 1, 8, 64, 2, selective_recompute=True), 8, "h100-80g", 1, 1, None)
    assert choice.values()["parallel.activation_checkpointing"] == "selective"
    assert choice.to_json()["activation_checkpointing"] == "selective"


def compose(corpus, overrides):
    from cli import TINY
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_config

    register_config()
    keep = [o for o in TINY if not o.startswith("train.micro_batch_size")]
    with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="test"):
        return hydra_compose("config", overrides=[*keep, f"data.paths=[{corpus}/*.txt]", "logging.wandb.mode=disabled",
                                                  "train.global_batch_size=24", "data.streams=4", *overrides])


def test_the_run_specification_follows_the_choice_and_leaves_the_config_alone(corpus, tmp_path, monkeypatch, capsys):
    from train.run.spec import resolve

    monkeypatch.setenv("WORLD_SIZE", "6")
    cfg = compose(corpus, ["parallel.layout=auto"])
    before = copy.deepcopy(OmegaConf.to_container(cfg))
    spec = resolve(cfg, tmp_path / "run", ["parallel.layout=auto"])
    assert OmegaConf.to_container(cfg) == before
    assert (spec.sections.parallel.tp, spec.sections.parallel.pp, spec.dp, spec.sections.train.micro_batch_size) == (1, 3, 2, 12)
    assert spec.layout.to_json()["pp"] == 3
    assert capsys.readouterr().out.startswith("gpt3d: layout auto for 6 processes on cpu: tp=1 pp=3 dp=2 zero=0 micro=12")
    manual = resolve(compose(corpus, ["parallel.pp=3", "train.micro_batch_size=4"]), tmp_path / "manual")
    assert manual.layout is None and (manual.dp, manual.sections.train.micro_batch_size) == (2, 4)


@pytest.mark.parametrize("world, overrides, message", [
    ("5", ["parallel.layout=auto"], "no layout of 5 processes is valid"),
    ("2", ["parallel.layout=auto", "train.micro_batch_size=4"], "drop train.micro_batch_size from the command line"),
    ("2", ["parallel.layout=auto", "parallel.pipeline_schedule=zb-h1"], "drop parallel.pipeline_schedule from the command line"),
    ("2", ["parallel.layout=fast"], "parallel.layout='fast': must be one of ['manual', 'auto']"),
])
def test_bad_layout_settings_are_one_config_error(corpus, tmp_path, monkeypatch, world, overrides, message):
    from train.run.spec import resolve

    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(compose(corpus, overrides), tmp_path / "run", overrides)
    assert "train.micro_batch_size" in AUTO_KEYS and "parallel.pipeline_schedule" in AUTO_KEYS
