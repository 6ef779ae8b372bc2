"""GPT-3's batch-size ramp: the schedule of batch sizes, its config checks, and DeepSpeed's gradient
accumulation following a batch that changes from step to step, against plain PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_distributed
from omegaconf import OmegaConf

from model import GPTConfig, build
from train.config.settings import ConfigError
from train.run.batch_ramp import BatchRamp, from_config
from train.run.checks import check_batch_ramp
from train.run.optimizer import Schedule


def _train(full=8, micro=1, **ramp):
    return OmegaConf.create({"global_batch_size": full, "micro_batch_size": micro,
                             "batch_ramp": {"start": None, "unit": "sequences", "increment": None, "tokens": None, **ramp}})


def test_gpt3_ramp_from_32k_tokens_to_half_a_million_over_4b_tokens():
    """gpt3-125m: 0.5M-token batches (256 of 2,048 tokens), ramped from 32,768 tokens (16 sequences) in 15
    increments of 16 sequences, one every 4e9 / 15 tokens."""
    ramp = from_config(_train(256, start=32768, unit="tokens", tokens=4e9), 2048)
    assert (ramp.start, ramp.increment, ramp.ramp_tokens, ramp.full) == (16, 16, 4_000_000_000, 256)
    assert ramp.size_at(0) == 16
    assert ramp.size_at(266_666_666) == 16 and ramp.size_at(266_666_667) == 32  # 4e9/15 = 266,666,666.7
    assert ramp.size_at(2_000_000_000) == 16 + 7 * 16  # ⌊7.5⌋ increments
    assert ramp.size_at(3_999_999_999) == 240 and ramp.size_at(4_000_000_000) == 256
    assert ramp.size_at(10**15) == 256


@pytest.mark.parametrize("start, increment, full, tokens",
                         [(16, 16, 256, 4e9), (2, 2, 8, 384), (3, 5, 23, 1000), (4, 4, 4, 1)])
def test_the_batch_stays_within_one_increment_below_the_straight_line(start, increment, full, tokens):
    """B(τ) is the straight line from (0, start) to (R, full), rounded down to start + a whole number of increments."""
    ramp = BatchRamp(start, increment, int(tokens), full, seq_len=32)
    r = int(tokens)
    for tau in [0, 1, *range(0, r + 1, max(r // 997, 1)), r - 1, r, 2 * r]:
        line = min(full, start + (full - start) * tau / tokens)
        size = ramp.size_at(tau)
        assert (size - start) % increment == 0 and size <= full
        assert 0 <= line - size < increment or size == full == line, (tau, size, line)


@pytest.mark.parametrize("start, increment, full, tokens, seq_len",
                         [(16, 16, 256, 4e9, 2048), (2, 2, 8, 384, 32), (3, 5, 23, 1000, 7)])
def test_tokens_after_a_number_of_steps(start, increment, full, tokens, seq_len):
    ramp = BatchRamp(start, increment, int(tokens), full, seq_len)
    seen, after = 0, [0]
    while seen < tokens or len(after) < 100:  # step by step, past the end of the ramp
        seen += ramp.size_at(seen) * seq_len
        after.append(seen)
    last = len(after) - 1
    for steps in (0, 1, 2, 7, 50, last // 3, last // 2, last - 1, last):
        assert ramp.tokens_after(steps) == after[steps]
    assert ramp.tokens_after(10**7) == after[last] + (10**7 - last) * full * seq_len


def test_no_ramp_is_the_full_batch_throughout():
    ramp = from_config(_train(8), 32)
    assert not ramp.enabled and ramp.size_at(0) == ramp.size_at(10**9) == 8 and ramp.tokens_after(5) == 5 * 8 * 32


@pytest.mark.parametrize(
    "ramp, message",
    [
        ({"start": 100, "unit": "tokens", "tokens": 1000},
         "train.batch_ramp.start=100 tokens is not a whole number of sequences of model.seq_len=32 tokens; use e.g. [96, 128]"),
        ({"start": 16, "tokens": 1000}, "train.batch_ramp.start=16 sequences exceeds train.global_batch_size=8"),
        ({"start": 2, "increment": 4, "tokens": 1000}, "increments that fit: [1, 2, 3, 6]"),
        ({"start": 2}, "train.batch_ramp.tokens=None: must be a positive whole number of tokens"),
        ({"start": 2, "tokens": 1.5}, "train.batch_ramp.tokens=1.5"),
        ({"start": 2, "tokens": 100, "unit": "samples"},
         "train.batch_ramp.unit='samples': must be one of ['sequences', 'tokens']"),
        ({"start": 0, "tokens": 100}, "train.batch_ramp.start=0: must be a positive whole number of sequences"),
        ({"start": True, "tokens": 100}, "train.batch_ramp.start=True"),
        ({"increment": 2}, "train.batch_ramp.increment=2 is set but train.batch_ramp.start is null"),
        ({"tokens": 4e9}, "train.batch_ramp.tokens=4000000000.0 is set but train.batch_ramp.start is null"),
    ],
)
def test_a_bad_ramp_is_refused_naming_the_value(ramp, message):
    with pytest.raises(ValueError) as err:
        from_config(_train(8, **ramp), 32)
    assert message in str(err.value)


def test_the_ramp_must_split_over_streams_ranks_and_micro_batches():
    """With 2 streams, micro batches of 2 and dp=2 every batch must be a multiple of lcm(2, 4) = 4 sequences."""
    model = GPTConfig(name="t", n_layer=1, n_head=1, d_model=8, seq_len=32, vocab_size=50257)
    cfg = OmegaConf.create({"train": _train(16, micro=2, start=2, tokens=1000)})
    with pytest.raises(ConfigError) as err:
        check_batch_ramp(cfg.train, model, dp=2, streams=2)
    assert ("train.batch_ramp.start=2 sequences (2 sequences) is not a multiple of 4 sequences, the least common "
            "multiple of data.streams=2 and train.micro_batch_size=2 × data-parallel size 2") in str(err.value)
    assert "start values that fit: [4, 8] sequences" in str(err.value)  # 12 does not divide 16
    cfg = OmegaConf.create({"train": _train(16, micro=2, start=256, unit="tokens", increment=64, tokens=1000)})
    fits = r"increment=64 tokens \(2 sequences\).*increment values that fit: \[128, 256\] tokens"
    with pytest.raises(ConfigError, match=fits):
        check_batch_ramp(cfg.train, model, dp=2, streams=2)
    fits = OmegaConf.create({"train": _train(16, micro=2, start=4, tokens=1000)})
    ramp = check_batch_ramp(fits.train, model, dp=2, streams=2)
    assert (ramp.start, ramp.increment, ramp.full) == (4, 4, 16)


# -- DeepSpeed follows the batch ---------------------------------------------------------------------------

CONFIG = GPTConfig(name="ramp-test", n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=300)
SIZES = [2, 6, 4, 8, 2]  # global batches (sequences) of consecutive steps
SCHEDULE = Schedule(peak_lr=1e-2, warmup_tokens=40, decay_tokens=1000, min_lr_ratio=0.1)
OPTIM = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 0.5}


def _windows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CONFIG.vocab_size, (n, CONFIG.seq_len + 1), generator=g) for n in SIZES]  # (n, T+1)


def ramp_worker(pp: int, zero: int, micro: int) -> dict:
    """Steps of SIZES sequences through the DeepSpeed engine the loop builds, the LR told the tokens seen;
    data-parallel rank r trains on rows [r·n/dp, (r+1)·n/dp) of each batch of n."""
    from parallel.build import build_model
    from parallel.naming import parameter_map
    from parallel.topology import Topology
    from train.run import engine as engines
    from train.run.optimizer import TokenLR, make_optimizer
    from train.run.step import TrainStep
    from train.runtime.process_group import init_distributed
    from train.runtime.resolve import Runtime

    init_distributed(torch.device("cpu"))
    fp32 = Runtime(torch.device("cpu"), "fp32")
    topology = Topology.create(1, pp)
    cfg = OmegaConf.create({
        "train": {"global_batch_size": max(SIZES), "micro_batch_size": micro, "precision": "fp32"},
        "parallel": {"tp": 1, "pp": pp, "zero_stage": zero, "offload_optimizer": False, "sequence_parallel": False},
        "optim": OPTIM,
    })
    part = build_model(CONFIG, topology, 7, "cpu")
    mpu = part.mpu() if pp > 1 else topology.mpu
    optimizer = make_optimizer(part, cfg.optim, SCHEDULE.peak_lr, clip=engines.clipping(cfg.parallel, fp32), mpu=mpu)
    lr = TokenLR(optimizer, SCHEDULE, SIZES[0] * CONFIG.seq_len)
    ds_config = engines.deepspeed_config(cfg.train, cfg.parallel, cfg.optim, {}, topology.dp_size, fp32)
    engine = engines.create_engine(part, optimizer, lr, ds_config, mpu=None if pp > 1 else mpu)
    step, tokens, results = TrainStep(engine, micro, torch.device("cpu")), 0, []
    dp, r = topology.dp_size, topology.dp_rank
    for windows in _windows():
        tokens += len(windows) * CONFIG.seq_len
        lr.set_tokens(tokens)
        n = len(windows) // dp
        result = step(windows[r * n : (r + 1) * n])
        loss = result.loss.detach().clone()
        torch.distributed.all_reduce(loss)  # the mean over dp ranks (pipeline stages hold the same loss)
        results.append((float(loss) / topology.world_size, result.grad_norm, result.lr))
    shards = parameter_map(part, CONFIG, topology)
    weights = {s.name: part.get_parameter(n).detach().clone() for n, s in shards.items() if not s.tied}
    return {"steps": results, "weights": weights}


@pytest.fixture(scope="module")
def reference() -> dict:
    """Plain PyTorch: each step one backward of the mean loss over the whole batch, clipping, AdamW at η(tokens seen)."""
    from train.run.optimizer import ELSEWHERE, make_optimizer

    model = build(CONFIG, "cpu", 7)
    optimizer = make_optimizer(model, OmegaConf.create(OPTIM), SCHEDULE.peak_lr, clip=ELSEWHERE)  # clipped below
    steps, tokens = [], 0
    for windows in _windows():
        tokens += len(windows) * CONFIG.seq_len
        for group in optimizer.param_groups:
            group["lr"] = SCHEDULE.lr_at(tokens)
        optimizer.zero_grad()
        loss = model(windows[:, :-1], windows[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"])
        optimizer.step()
        steps.append((loss.item(), norm.item(), SCHEDULE.lr_at(tokens)))
    return {"steps": steps, "weights": dict(model.named_parameters())}


@pytest.mark.parametrize(
    "world, pp, zero, micro",
    [(1, 1, 0, 2), (2, 2, 1, 2), (2, 1, 2, 1), (2, 1, 3, 1)],
    ids=["one-process", "pipeline-2-zero1", "dp2-zero2", "dp2-zero3"],
)
def test_each_step_is_one_update_on_the_mean_gradient_of_its_whole_batch(reference, world, pp, zero, micro):
    """Losses, pre-clip gradient norms (a wrong 1/accumulation scale would show here), learning rates and the
    weights after all steps equal plain PyTorch's, for batches of 1, 3, 2, 4, 1 micro batches per rank."""
    ranks = run_distributed(ramp_worker, world, pp, zero, micro)
    for k, (expected, got) in enumerate(zip(reference["steps"], ranks[0]["steps"])):
        assert got[0] == pytest.approx(expected[0], rel=1e-5), f"loss, step {k}"
        assert got[1] == pytest.approx(expected[1], rel=1e-4), f"gradient norm, step {k}"
        assert got[2] == expected[2], f"learning rate, step {k}"
    assert reference["steps"][0][1] > OPTIM["grad_clip"]  # clipping is active: the norm's scale matters
    for rank in ranks:
        for name, tensor in rank["weights"].items():
            expected = reference["weights"][name].detach()
            torch.testing.assert_close(tensor, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert sum(len(r["weights"]) for r in ranks) >= len(reference["weights"])
    assert not math.isclose(reference["steps"][0][0], reference["steps"][-1][0])  # the model did train
