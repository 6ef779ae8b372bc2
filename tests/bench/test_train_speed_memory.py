"""bench.train_speed's plain rows one at a time (what gpt3-760m and gpt3-1.3b need on an 80 GB GPU): each
model is freed before the next one is built, and every row still runs all its rounds."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import bench.train_speed as train_speed
from model import GPTConfig


@pytest.fixture
def builds(monkeypatch) -> list[int]:
    """For each plain model built, how many of the models built before it were still alive then. The
    DeepSpeed rows fail at once (they are not what this checks)."""
    live: weakref.WeakSet = weakref.WeakSet()
    alive_at_build: list[int] = []

    def tracked(make):
        def wrapper(*args, **kwargs):
            gc.collect()
            alive_at_build.append(len(live))
            model = make(*args, **kwargs)
            live.add(model)
            return model
        return wrapper

    def no_engine(*args, **kwargs):
        raise RuntimeError("no DeepSpeed engine in this test")

    monkeypatch.setattr(train_speed, "build", tracked(train_speed.build))
    monkeypatch.setattr(train_speed, "hf_gpt2", tracked(train_speed.hf_gpt2))
    monkeypatch.setattr(train_speed, "engine_trainer", no_engine)
    return alive_at_build


def toy_benchmark(one_at_a_time):
    small = {"seq_len": 16, "vocab_size": 512, "n_layer": 2, "d_model": 32, "n_head": 2, "d_ff": 128}
    config = GPTConfig.from_dict({**train_speed.load_model_config("toy"), **small})
    rows, _, _ = train_speed.benchmark("toy", config, 1, 1, 2, torch.device("cpu"), None, one_at_a_time)
    return rows[:4]  # the plain rows


def test_one_at_a_time_frees_each_plain_model_before_the_next_is_built(builds, capsys):
    plain = toy_benchmark(one_at_a_time=True)
    assert builds == [0, 0, 0, 0]
    assert "plain rows one at a time, each freed before the next is built" in capsys.readouterr().out
    for row in plain:
        assert row.error is None and len(row.step_s) == 2 and len(row.losses) == 3 and not row.alternated
        assert row.model is None and row.opt is None
    # the two gpt3d rows with the same model and attention (fused loss or not) start from the same loss
    assert plain[1].losses[0] == pytest.approx(plain[2].losses[0], rel=1e-5)


def test_alternating_rows_are_all_alive_together(builds):
    """The default on a CPU (and for models that fit together on a GPU): the count above sees them."""
    plain = toy_benchmark(one_at_a_time=None)
    assert builds == [0, 1, 2, 3]
    assert all(row.alternated and len(row.step_s) == 2 for row in plain)


def test_the_fp8_pair_builds_no_plain_row_and_one_engine_per_precision(builds, monkeypatch):
    """--fp8-pair: DeepSpeed's bf16 and fp8 rows only, bf16 first (the baseline), compiled on a GPU alone."""
    engines = []

    def no_engine(model_name, precision, micro_batch, seq_len, device, recipe=None, compiled=False):
        engines.append((precision, recipe, compiled))
        raise RuntimeError("no DeepSpeed engine in this test")

    monkeypatch.setattr(train_speed, "engine_trainer", no_engine)
    small = {"seq_len": 16, "vocab_size": 512, "n_layer": 2, "d_model": 32, "n_head": 2, "d_ff": 128}
    config = GPTConfig.from_dict({**train_speed.load_model_config("toy"), **small})
    rows, _, _ = train_speed.benchmark("toy", config, 1, 1, 2, torch.device("cpu"), None, fp8_pair=True)
    assert builds == [] and engines == [("bf16", None, False), ("fp8", "tensorwise", False)]
    assert [row.name for row in rows] == ["gpt3d deepspeed precision=bf16", "gpt3d deepspeed precision=fp8"]


def test_engine_only_builds_the_named_engine_rows_and_no_plain_row(builds, monkeypatch):
    """--engine-only bf16,bf16-compiled: those DeepSpeed rows alone, in the order named (the GPU suite's step at
    65,536 tokens); an unknown row name is refused in one line."""
    engines = []

    def no_engine(model_name, precision, micro_batch, seq_len, device, recipe=None, compiled=False):
        engines.append((precision, recipe, compiled, micro_batch))
        raise RuntimeError("no DeepSpeed engine in this test")

    monkeypatch.setattr(train_speed, "engine_trainer", no_engine)
    small = {"seq_len": 16, "vocab_size": 512, "n_layer": 2, "d_model": 32, "n_head": 2, "d_ff": 128}
    config = GPTConfig.from_dict({**train_speed.load_model_config("toy"), **small})
    rows, _, _ = train_speed.benchmark("toy", config, 4, 1, 2, torch.device("cpu"), None,
                                       engine_only=["bf16", "bf16-compiled"])
    assert builds == [] and engines == [("bf16", None, False, 4), ("bf16", None, True, 4)]
    monkeypatch.setattr("sys.argv", ["bench.train_speed", "model=toy", "--device", "cpu", "--engine-only", "bf16,bf17"])
    with pytest.raises(SystemExit):
        train_speed.main()
