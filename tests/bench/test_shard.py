"""bench.shard on a CPU at toy sizes: one tensor-parallel rank's share of a block runs forward and
backward alone, holds the full block's parameters divided by tp, and is printed against the plan."""

from __future__ import annotations

import io

import torch

from bench.shard import build_block_shard, fake_tensor_parallel_rank, run
from model import GPTConfig
from model.gpt import make_layer

TOY = GPTConfig(name="toy", n_layer=2, n_head=4, d_model=32, seq_len=32)
# the dimension tensor parallelism cuts: column-parallel outputs (0), row-parallel inputs (1)
CUT = {"attn.qkv.weight": 0, "attn.qkv.bias": 0, "mlp.fc.weight": 0, "mlp.fc.bias": 0,
       "attn.proj.weight": 1, "mlp.proj.weight": 1}


def test_the_shard_holds_the_full_blocks_parameters_divided_by_tp():
    with torch.device("meta"):
        full = {name: p.shape for name, p in make_layer(TOY, 1).named_parameters()}
    with fake_tensor_parallel_rank(2) as topology:
        shard = {name: p.shape for name, p in build_block_shard(TOY, topology, False, torch.device("cpu")).named_parameters()}
    assert shard.keys() == full.keys()
    for name, shape in full.items():
        expected = list(shape)
        if name in CUT:
            expected[CUT[name]] //= 2
        assert list(shard[name]) == expected, name  # LayerNorms and row-parallel biases whole


def test_runs_forward_and_backward_and_prints_measured_and_predicted():
    out, err = io.StringIO(), io.StringIO()
    overrides = ["model=toy", "model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.seq_len=32", "model.d_ff=128",
                 "parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=2",
                 "bench.iterations=2", "bench.warmup=1"]
    assert run(overrides, out, err) == 0, err.getvalue()
    text = out.getvalue()
    assert "2 of 4 heads, d_ff 64 of 128, micro batch 2 × T 32" in text and "sequence parallelism" in text
    measured, predicted = (float(text.split(word)[1].split()[0]) for word in ("measured ", "predicted "))
    assert measured > 0 and predicted > 0


def test_bad_option_is_one_error():
    out, err = io.StringIO(), io.StringIO()
    assert run(["model=toy", "parallel.tp=3"], out, err) == 2
    assert "tp" in err.getvalue() and not out.getvalue()
    assert run(["model=toy", "bench.rounds=2"], out, err) == 2
    assert "bench options are ['iterations', 'seed', 'warmup']" in err.getvalue()


def test_fp8_times_bf16_then_each_recipe_on_the_linears_the_run_would_choose():
    out, err = io.StringIO(), io.StringIO()
    overrides = ["model=toy", "model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.seq_len=32", "model.d_ff=128",
                 "parallel.tp=2", "train.micro_batch_size=1", "bench.iterations=1", "bench.warmup=0",
                 "train.precision=fp8", "train.fp8_linears=[mlp.fc]"]
    assert run(overrides, out, err) == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert lines[1] == "blocks eager: on cpu the float8 products are emulated (model.compile=true compiles them)"
    timed = [line.split(":")[0] for line in lines if line.startswith("forward + backward per block")]
    assert timed == [f"forward + backward per block, {row}" for row in ("bf16", "fp8 tensorwise", "fp8 rowwise")]
    for recipe in ("tensorwise", "rowwise"):
        assert (f"fp8 {recipe}: 2 of 8 block linears in float8 (mlp.fc; attn.qkv, attn.proj, mlp.proj in bf16), head "
                f"in bf16, as train.fp8_linears=[mlp.fc] says") in lines
    assert all("× bf16's speed" in line for line in lines if line.startswith("forward + backward per block, fp8"))
