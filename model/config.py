"""Model hyper-parameters: one dataclass whose fields are exactly the keys of configs/model/*.yaml."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ACTIVATIONS = ("gelu", "relu")
ATTENTION_PATTERNS = ("dense", "alternating")
ATTENTION_IMPLS = ("auto", "triton", "torch", "sdpa", "reference")


def _field(default, doc: str):
    """A field with its doc (docs/configuration.md's settings table: train/config/key_table.py)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-3-style decoder.

    d_head = d_model / n_head; d_ff defaults to 4·d_model. With attention_pattern="alternating",
    odd layers (1, 3, 5, ...) attend only to the last `local_window` positions (GPT-3's locally
    banded layers); even layers stay dense. deterministic_attention=True makes the attention's
    backward give the same bits on every run (model.attention: the Triton kernel then computes dQ in
    a pass of its own, without atomic adds; it cannot be combined with attention_impl="sdpa").
    compile=True runs each transformer Block through torch.compile (model/compile.py), eager where
    compilation is unavailable; an execution option like attention_impl: the weights, and so
    checkpoints, are the same either way.
    """

    name: str = _field("toy", "the size's name (configs/model/NAME.yaml): toy, gpt3-125m … gpt3-175b")
    n_layer: int = _field(4, "transformer blocks")
    n_head: int = _field(4, "attention heads; d_head = d_model / n_head")
    d_model: int = _field(128, "hidden width")
    d_ff: int | None = _field(None, "MLP width; null: 4·d_model")
    seq_len: int = _field(256, "context length, tokens")
    vocab_size: int = _field(50257, "vocabulary (GPT-2 BPE: 50257; padded to a multiple of 128·tp rows inside)")
    activation: str = _field("gelu", "`gelu` (tanh approximation) or `relu`")
    attention_pattern: str = _field("dense", "`dense`, or `alternating` dense/banded layers (GPT-3's)")
    local_window: int = _field(256, "the banded layers' window, tokens")
    attention_impl: str = _field(
        "auto", "`auto`: the fused Triton kernel on GPUs (bf16/fp16), PyTorch's SDPA for float32 there, the chunked "
                "torch path on CPUs; or force `triton`, `sdpa`, `torch`, `reference`")
    deterministic_attention: bool = _field(
        False, "an attention backward whose gradient bits are the same on every run (the Triton kernel computes dQ in "
               "a pass of its own instead of with atomic adds); refused with attention_impl=sdpa; checkpoints resume "
               "with it on or off")
    compile: bool = _field(False, "each transformer block through torch.compile (eager, with one warning, where that "
                                  "cannot work); generation runs eager; checkpoints resume with it on or off")
    dropout: float = _field(0.0, "dropout probability (GPT-3: 0)")
    init_std: float = _field(0.02, "the weights' init standard deviation (residual projections: /√(2·n_layer))")
    ln_eps: float = _field(1e-5, "LayerNorm's ε")

    def __post_init__(self) -> None:
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        for key in ("n_layer", "n_head", "d_model", "d_ff", "seq_len", "vocab_size", "local_window"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{key}={value!r}: must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}: "
                f"d_head must be a whole number (divisors of {self.d_model} near {self.n_head}: "
                f"{_nearby_divisors(self.d_model, self.n_head)})"
            )
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("attention_pattern", self.attention_pattern, ATTENTION_PATTERNS)
        _check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        if not isinstance(self.deterministic_attention, bool):
            raise ValueError(f"model.deterministic_attention={self.deterministic_attention!r}: must be true or false")
        if not isinstance(self.compile, bool):
            raise ValueError(f"model.compile={self.compile!r}: must be true or false")
        if self.deterministic_attention and self.attention_impl == "sdpa":
            raise ValueError("model.deterministic_attention=true with model.attention_impl='sdpa': PyTorch's SDPA "
                             "backward is not deterministic on every backend; use attention_impl auto, triton or torch")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout!r}: must be in [0, 1)")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    def window_of(self, layer_index: int) -> int | None:
        """Attention window of one layer: None for dense, `local_window` for GPT-3's banded layers."""
        if self.attention_pattern == "alternating" and layer_index % 2 == 1:
            return self.local_window
        return None

    @classmethod
    def from_dict(cls, values: dict) -> "GPTConfig":
        """Build from a config mapping, naming any unknown key and the valid ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**values)


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"model.{key}={value!r}: must be one of {list(choices)}")


def _nearby_divisors(n: int, near: int) -> list[int]:
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    return sorted(divisors, key=lambda k: abs(k - near))[:3]
