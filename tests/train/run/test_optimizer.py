"""GPT-3's optimizer settings and the token-based warmup + cosine schedule."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from train.run.optimizer import Schedule, TokenLR, make_optimizer, make_schedule, param_groups

OPTIM = OmegaConf.create(
    {
        "lr": None, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0,
        "warmup_tokens": 1000, "decay_tokens": 11000, "min_lr_ratio": 0.1,
    }
)


def test_schedule_at_warmup_end_mid_decay_and_floor():
    s = make_schedule(OPTIM, "gpt3-125m", run_tokens=100 * 1000)
    peak = 6.0e-4  # the paper's 125M learning rate
    assert s.lr_at(0) == 0.0
    assert s.lr_at(500) == pytest.approx(peak / 2)
    assert s.lr_at(1000) == pytest.approx(peak)  # warmup end
    # halfway through the cosine: ½(1 + cos(π/2)) = ½, so 0.1 + 0.9·½ = 0.55 of the peak
    assert s.lr_at(6000) == pytest.approx(0.55 * peak)
    # a quarter through: ½(1 + cos(π/4))
    assert s.lr_at(3500) == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))))
    assert s.lr_at(11000) == pytest.approx(0.1 * peak)  # the floor
    assert s.lr_at(10**9) == pytest.approx(0.1 * peak)


def test_short_runs_cap_warmup_at_a_tenth_and_decay_over_the_run():
    cfg = OmegaConf.merge(OPTIM, {"warmup_tokens": 375_000_000, "decay_tokens": None, "lr": 1e-3})
    s = make_schedule(cfg, "toy", run_tokens=1024 * 200)
    assert s.warmup_tokens == 1024 * 20 and s.decay_tokens == 1024 * 200 and s.peak_lr == 1e-3


def test_a_warmup_set_by_hand_is_used_as_given_or_refused_when_it_outlasts_the_decay():
    cfg = OmegaConf.merge(OPTIM, {"warmup_tokens": 50_000, "decay_tokens": None, "lr": 1e-3})
    s = make_schedule(cfg, "toy", run_tokens=1024 * 200, warmup_set=True)
    assert s.warmup_tokens == 50_000 and s.decay_tokens == 1024 * 200  # not the tenth of the run, 20,480
    with pytest.raises(ValueError, match="optim.warmup_tokens=375,000,000 does not end before the run's 204,800 tokens"):
        make_schedule(OmegaConf.merge(cfg, {"warmup_tokens": 375_000_000}), "toy", 1024 * 200, warmup_set=True)


def test_explicit_lr_overrides_the_paper_and_unknown_names_need_one():
    assert make_schedule(OmegaConf.merge(OPTIM, {"lr": 3e-4}), "gpt3-175b", 100_000).peak_lr == 3e-4
    with pytest.raises(ValueError, match="optim.lr is null and model.name='mine'"):
        make_schedule(OPTIM, "mine", 100_000)


def test_token_lr_follows_the_tokens_it_is_told_and_resumes_from_its_state():
    model = torch.nn.Linear(4, 4)
    s = Schedule(peak_lr=1.0, warmup_tokens=400, decay_tokens=2000, min_lr_ratio=0.1)
    opt = make_optimizer(model, OPTIM, s.peak_lr)
    sched = TokenLR(opt, s, first_step_tokens=100)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]  # 100 of 400 warmup tokens
    seen, tokens = [], 0
    for batch in (100, 100, 200, 300, 300, 1000):  # tokens per step, growing as under a batch ramp
        tokens += batch
        sched.set_tokens(tokens)  # the tokens seen once this step is done
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()  # DeepSpeed's call after the update moves nothing
        assert opt.param_groups[1]["lr"] == seen[-1]
    cosine = lambda t: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 400) / 1600))
    assert seen == pytest.approx([0.25, 0.5, 1.0, cosine(700), cosine(1000), 0.1])
    fresh = TokenLR(make_optimizer(torch.nn.Linear(4, 4), OPTIM, 1.0), s, first_step_tokens=100)
    fresh.load_state_dict(sched.state_dict())
    assert fresh.get_last_lr() == sched.get_last_lr() == [0.1, 0.1] and sched.state_dict() == {"tokens": 2000}


def test_weight_decay_only_on_matrices_and_adam_settings():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = param_groups(model, 0.1)
    assert {p.dim() for p in groups[0]["params"]} == {2} and len(groups[0]["params"]) == 2
    assert {p.dim() for p in groups[1]["params"]} == {1} and len(groups[1]["params"]) == 3
    opt = make_optimizer(model, OPTIM, 1e-3)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_clipping_adamw_clips_to_the_global_norm_and_records_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(16, 8) * 10
    for net in (model, reference):
        net(x).pow(2).sum().backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)  # torch's own
    opt = make_optimizer(model, OmegaConf.merge(OPTIM, {"grad_clip": 0.5}), 1e-2)
    assert expected_norm > 0.5  # clipping is active
    opt.step()
    assert opt._global_grad_norm == pytest.approx(float(expected_norm), rel=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)  # clipped in place, as torch clips


def _one_layer_with_grads(scale: float):
    model = torch.nn.Linear(4, 4)
    for p in model.parameters():
        p.grad = torch.full_like(p, scale)
    return model


def test_grad_clip_zero_measures_without_clipping():
    model = _one_layer_with_grads(3.0)
    before = [p.grad.clone() for p in model.parameters()]
    opt = make_optimizer(model, OmegaConf.merge(OPTIM, {"grad_clip": 0.0}), 1e-3)
    opt.step()
    assert opt._global_grad_norm == pytest.approx(3.0 * 20**0.5)  # 20 gradient entries of 3
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_norm_skips_the_update_on_the_device(bad):
    """The skip is decided on the device (fused AdamW's found_inf) and reported as a device flag; the host-side
    `overflow` DeepSpeed reads stays False (the loop counts the skip when it reads the flag)."""
    model = _one_layer_with_grads(1.0)
    weights = [p.detach().clone() for p in model.parameters()]
    opt = make_optimizer(model, OPTIM, 1e-3)
    opt.step()  # a finite step first: Adam has moments and a step count to keep
    assert float(opt.skipped) == 0.0
    moved = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(weights, moved))
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    for p in model.parameters():
        p.grad.fill_(1.0)  # the first step clipped them in place
    model.weight.grad[0, 0] = bad
    opt.step()
    assert float(opt.skipped) == 1.0 and not opt.overflow and not math.isfinite(opt._global_grad_norm)
    assert model.bias.grad.eq(1.0).all()  # not negated or scaled
    for p, before in zip(model.parameters(), moved):
        assert torch.equal(p.detach(), before)  # no weight change
    for key, value in opt.state[model.weight].items():
        assert torch.equal(value, state[key]), key  # moments and Adam's step count unchanged
    model.weight.grad[0, 0] = 1.0
    opt.step()  # the next finite step updates again
    assert float(opt.skipped) == 0.0 and float(opt.state[model.weight]["step"]) == 2
