"""The KV cache: logits of cached steps against re-encoding the whole context (fp32, 1e-5), the
keys a banded layer keeps, generation past the local window and past the position table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from cli import run_module

from model import GPTConfig, KVCache, build, generate
from model.decoding import Decoder

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5


def config(pattern: str, window: int = 4) -> GPTConfig:
    return GPTConfig(name="kv", n_layer=4, n_head=2, d_model=32, seq_len=48, vocab_size=97,
                     attention_pattern=pattern, local_window=window)


def assert_rel_close(actual, expected, what):
    error = (actual - expected).abs().max().item() / expected.abs().max().item()
    assert error <= TOL, f"{what}: relative error {error:.2e} > {TOL:.0e}"


@pytest.mark.parametrize("pattern", ["dense", "alternating"])
def test_cached_logits_equal_uncached_at_every_generated_position(pattern):
    """A prompt of 5 tokens, then 30 tokens fed one at a time (every odd layer's window is 4, so
    most steps reach past it): each step's logits equal those of the full forward over the prefix."""
    torch.manual_seed(0)
    model = build(config(pattern), seed=3).eval()
    tokens = torch.randint(0, 97, (2, 35))
    cache = KVCache()
    with torch.no_grad():
        steps = [model(tokens[:, :5], cache=cache)]  # (2, 5, V): the prompt at once
        steps += [model(tokens[:, t : t + 1], cache=cache) for t in range(5, 35)]  # (2, 1, V) each
        cached = torch.cat(steps, dim=1)  # (2, 35, V)
        for t in range(35):
            expected = model(tokens[:, : t + 1])[:, -1]  # re-encode the whole prefix
            assert_rel_close(cached[:, t], expected, f"{pattern}: position {t}")
    assert cache.seen == 35


def test_banded_layers_keep_only_their_window():
    model = build(config("alternating", window=6), seed=1).eval()
    cache = KVCache()
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 20)), cache=cache)
        model(torch.randint(0, 97, (1, 1)), cache=cache)
    assert [cache.held(block) for block in range(4)] == [21, 5, 21, 5]  # window 6: 5 earlier keys suffice


@pytest.mark.parametrize("pattern", ["dense", "alternating"])
def test_greedy_generation_with_cache_equals_without(pattern):
    """60 new tokens after 10: past the window, and past seq_len = 48, where the context slides."""
    model = build(config(pattern), seed=5).eval()
    prompt = torch.randint(0, 97, (3, 10), generator=torch.Generator().manual_seed(2))
    cached = generate(model, prompt, 60, temperature=0)
    uncached = generate(model, prompt, 60, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 10:].tolist())) > 3  # not one repeated token: the comparison has teeth


def test_sampling_with_cache_equals_without():
    model = build(config("alternating"), seed=5).eval()
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(4))
    runs = [generate(model, prompt, 30, temperature=0.9, top_k=20, generator=torch.Generator().manual_seed(8),
                     use_cache=use) for use in (True, False)]
    assert torch.equal(*runs)


def test_a_decoder_wraps_any_module_with_a_config():
    """generate() takes a module whose forward(tokens[, cache=]) gives logits, or a Decoder."""
    model = build(config("dense"), seed=2).eval()
    prompt = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate(Decoder(model), prompt, 12, temperature=0), generate(model, prompt, 12, temperature=0))


def test_cache_past_the_position_table_is_refused():
    model = build(config("dense"), seed=2).eval()
    cache = KVCache()
    model(torch.zeros(1, 40, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="sequence of 49 tokens exceeds model.seq_len=48"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)


def test_generation_benchmark_quick_reports_cached_against_uncached():
    """The benchmark works (it checks that both modes produce the same tokens); figures come from
    full runs, not from a test."""
    proc = run_module("bench.generate", ["--quick", "--threads", "1"], env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith(("cached", "uncached"))}
    assert set(rows) == {"cached", "uncached"}, proc.stdout
    assert (float(rows["uncached"][4]), float(rows["uncached"][-1])) == (1.0, 1.0)  # the baseline against itself
