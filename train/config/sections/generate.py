"""`generate.*`: `python -m train.generate`, a prompt continued with a trained run's weights at any layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from train.config.settings import POSITIVE_INT, Check, ConfigError, Section, is_number, setting


@dataclass
class GenerateConfig(Section):
    """`generate.*` (see the module docstring)."""

    PREFIX: ClassVar[str] = "generate"
    checkpoint: Optional[str] = setting(None, "a run directory, its checkpoints/ folder (the latest checkpoint) or one "
                                              "step folder")
    prompt: Any = setting("The", "the text to continue", Check(lambda v: isinstance(v, str),
                                                                 "must be a string (quote it on the command line)"))
    max_new_tokens: int = setting(64, "tokens to generate", POSITIVE_INT)
    temperature: Any = setting(0.8, "0: greedy (argmax); otherwise sample from softmax(logits / temperature)",
                               Check(lambda v: is_number(v) and v >= 0, "must be ≥ 0 (0: greedy)"))
    top_k: Optional[int] = setting(50, "sample among the k most likely tokens; null: among all",
                                   Check(lambda v: v is None or POSITIVE_INT(v), "must be a positive integer"))
    output: Optional[str] = setting(None, "a file to write the result to as JSON (prompt, token ids, text); null: "
                                          "print only")

    def check(self) -> None:
        if self.checkpoint is None:
            raise ConfigError("generate.checkpoint is not set: give a run directory, its checkpoints/ folder or one "
                              "step folder")
