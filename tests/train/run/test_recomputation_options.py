"""parallel.activation_checkpointing and parallel.overlap_communication: bad values fail early, naming
the value and what is valid (the parallel section's own checks, train/config/sections/parallel.py)."""

from __future__ import annotations

import pytest

from model import GPTConfig
from train.config.sections import ParallelConfig
from train.config.settings import ConfigError
from train.run.checks import check_parallel

MODEL = GPTConfig(name="toy", n_layer=2, n_head=2, d_model=32, seq_len=32, vocab_size=100)


@pytest.mark.parametrize("value", [0, 2, "selective"])
def test_activation_checkpointing_accepts_off_a_block_count_or_selective(value):
    assert check_parallel(ParallelConfig(activation_checkpointing=value), MODEL, {}) == 1


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
        ParallelConfig(**{key: value})
    assert message in str(error.value)
