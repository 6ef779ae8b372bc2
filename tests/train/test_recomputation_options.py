"""parallel.activation_checkpointing and parallel.overlap_communication: bad values fail early, naming
the value and what is valid (train.config.checks.check_parallel)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from model import GPTConfig
from train.config.checks import ConfigError, check_parallel

MODEL = GPTConfig(name="toy", n_layer=2, n_head=2, d_model=32, seq_len=32, vocab_size=100)


def _parallel(**overrides):
    base = {"tp": 1, "pp": 1, "zero_stage": 0, "offload_optimizer": False, "sequence_parallel": False,
            "activation_checkpointing": 0, "overlap_communication": True}  # fmt: skip
    return OmegaConf.create({"parallel": {**base, **overrides}})


@pytest.mark.parametrize("value", [0, 2, "selective"])
def test_activation_checkpointing_accepts_off_a_block_count_or_selective(value):
    assert check_parallel(_parallel(activation_checkpointing=value), MODEL) == 1


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("activation_checkpointing", "selectve", "parallel.activation_checkpointing='selectve': must be 0 (off), a positive block count or 'selective'"),
        ("activation_checkpointing", -1, "parallel.activation_checkpointing=-1"),
        ("overlap_communication", "yes", "parallel.overlap_communication='yes': must be true or false"),
    ],
)
def test_bad_values_are_refused_with_the_value_and_what_is_valid(key, value, message):
    with pytest.raises(ConfigError) as error:
        check_parallel(_parallel(**{key: value}), MODEL)
    assert message in str(error.value)
