"""GPT-3's batch-size ramp: the global batch grows from a small start to the full batch over the first
tokens of training (Brown et al. 2020, §B: from 32k tokens to the full batch over the first 4–12B tokens).

The batch is a pure function of the tokens seen, τ. With start B₀, full batch G, increment Δ (all in
sequences; G − B₀ a multiple of Δ) and ramp length R tokens, the ramp has n = (G − B₀) / Δ increments,
one every R / n tokens:

    B(τ) = min(G, B₀ + Δ · ⌊τ · n / R⌋)

in exact integer arithmetic, so a resumed run (which restores τ) takes the same batches, and every
layout takes the same batches (nothing here depends on dp or the micro batch). Without a ramp
(`train.batch_ramp.start: null`) B(τ) = G.

Config (`train.batch_ramp`): `start` (null: off), `unit` (`sequences` or `tokens`, for start and
increment; tokens must be whole sequences), `increment` (null: the start), `tokens` (R).
"""

from __future__ import annotations

from dataclasses import dataclass

from train.config.sections import TrainConfig

UNITS = ("sequences", "tokens")


@dataclass(frozen=True)
class BatchRamp:
    """Global batch size (sequences) as a function of tokens seen; see the module docstring."""

    start: int  # B₀, sequences
    increment: int  # Δ, sequences
    ramp_tokens: int  # R
    full: int  # G = train.global_batch_size, sequences
    seq_len: int  # tokens trained on per sequence

    @property
    def enabled(self) -> bool:
        return self.start < self.full

    @property
    def increments(self) -> int:
        return (self.full - self.start) // self.increment

    def size_at(self, tokens: int) -> int:
        """B(τ): sequences in the global batch of the step that starts after `tokens` tokens."""
        if not self.enabled:
            return self.full
        return min(self.full, self.start + self.increment * (tokens * self.increments // self.ramp_tokens))

    def tokens_after(self, steps: int) -> int:
        """Tokens seen after `steps` optimizer steps, walking the ramp one batch size at a time."""
        tokens = 0
        while steps > 0 and self.size_at(tokens) < self.full:
            batch = self.size_at(tokens) * self.seq_len
            k = tokens * self.increments // self.ramp_tokens + 1  # the next increment comes at ⌈k·R/n⌉ tokens
            until = -(-k * self.ramp_tokens // self.increments)
            n = min(steps, -(-(until - tokens) // batch))  # steps at this size
            tokens, steps = tokens + n * batch, steps - n
        return tokens + steps * self.full * self.seq_len


def from_config(train_cfg: TrainConfig, seq_len: int) -> BatchRamp:
    """The run's ramp from the train section's global_batch_size and batch_ramp (train/config/sections/train.py);
    ValueError naming a bad value.

    This checks the ramp on its own; whether its batches split over streams, ranks and micro batches
    is train/run/checks.py's check (it knows the layout)."""
    full = train_cfg.global_batch_size
    ramp = train_cfg.batch_ramp
    if ramp.start is None:
        for key in ("increment", "tokens"):
            if getattr(ramp, key) is not None:
                raise ValueError(f"train.batch_ramp.{key}={getattr(ramp, key)!r} is set but train.batch_ramp.start is "
                                 f"null (no ramp); set start too, or leave {key} null")
        return BatchRamp(full, full, 1, full, seq_len)
    unit = ramp.unit
    if unit not in UNITS:
        raise ValueError(f"train.batch_ramp.unit={unit!r}: must be one of {list(UNITS)}")
    start = _sequences("start", ramp.start, unit, seq_len)
    if start > full:
        raise ValueError(f"train.batch_ramp.start={ramp.start} {unit} exceeds train.global_batch_size={full} sequences "
                         f"({full * seq_len} tokens); the ramp grows towards the full batch")
    increment = start if ramp.increment is None else _sequences("increment", ramp.increment, unit, seq_len)
    if (full - start) % increment:
        per = seq_len if unit == "tokens" else 1
        fits = [d * per for d in range(1, full - start + 1) if (full - start) % d == 0]
        raise ValueError(
            f"train.batch_ramp.increment={ramp.increment or ramp.start} {unit} does not lead from start="
            f"{ramp.start} to train.global_batch_size={full} sequences in whole increments (the difference, "
            f"{(full - start) * per} {unit}, must be a multiple of it); increments that fit: {fits[:8]}"
        )
    tokens = ramp.tokens
    if start < full and (not _is_whole(tokens) or tokens <= 0):
        raise ValueError(f"train.batch_ramp.tokens={tokens!r}: must be a positive whole number of tokens (e.g. 4e9), "
                         "the tokens over which the batch grows to the full batch")
    return BatchRamp(start, increment, int(tokens) if start < full else 1, full, seq_len)


def _sequences(key: str, value, unit: str, seq_len: int) -> int:
    """A start or increment in sequences."""
    if not _is_whole(value) or value <= 0:
        raise ValueError(f"train.batch_ramp.{key}={value!r}: must be a positive whole number of {unit}")
    value = int(value)
    if unit == "sequences":
        return value
    if value % seq_len:
        low, high = value // seq_len * seq_len, -(-value // seq_len) * seq_len
        near = [n for n in (low, high) if n > 0]
        raise ValueError(f"train.batch_ramp.{key}={value} tokens is not a whole number of sequences of model.seq_len="
                         f"{seq_len} tokens; use e.g. {near}")
    return value // seq_len


def _is_whole(value) -> bool:
    """An int, or a float that is one (YAML reads 4e9 as a float)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
