"""A config section: a dataclass whose every field carries its doc and its check.

    @dataclass
    class TrainConfig(Section):
        PREFIX: ClassVar[str] = "train"
        max_steps: int = setting(200, "optimizer steps to run", POSITIVE_INT)

Each section is a Hydra structured config (registered in train/config/schema.py), so OmegaConf
type-checks a value when the config is composed (`train.max_steps=abc`: not an integer); the
command-line check (train/config/command_line.py) turns such a refusal into the field's own words.
Building the section object (OmegaConf.to_object, in train/run/spec.py: resolve) runs
`__post_init__`: every field's check, then the section's own `check()` for what spans its fields.
The first failure is one ConfigError, "gpt3d: error: train.max_steps=-3: must be a positive
integer". After that the object is sealed: a component that receives it can read it, never change
it. docs/configuration.md's key table is generated from the fields' docs (train/config/key_table.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

NOT_SET = object()


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names it and the valid choices."""


@dataclass(frozen=True)
class Check:
    """A test a value must pass, and what a valid value is, as the refusal says it ("must be …");
    `words`, when given, words the whole refusal of a value at a key instead ("data.encoding='x' is not
    an encoding Python knows; …")."""

    test: Callable[[Any], bool]
    must: str
    words: Callable[[str, Any], str] | None = None

    def __call__(self, value) -> bool:
        return bool(self.test(value))

    def refusal(self, key: str, value) -> str:
        """The one line that refuses `value` at `key`."""
        return self.words(key, value) if self.words is not None else f"{key}={value!r}: {self.must}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


POSITIVE_INT = Check(lambda v: _is_int(v) and v > 0, "must be a positive integer")
NON_NEGATIVE_INT = Check(lambda v: _is_int(v) and v >= 0, "must be a non-negative integer")
BOOLEAN = Check(lambda v: isinstance(v, bool), "must be true or false")
POSITIVE_SECONDS = Check(lambda v: is_number(v) and v > 0 and math.isfinite(v), "must be a positive number of seconds")
OPTIONAL_TEXT = Check(lambda v: v is None or isinstance(v, str), "must be text (or null)")


def non_negative_int(zero_means: str) -> Check:
    return Check(NON_NEGATIVE_INT.test, f"must be a non-negative integer (0: {zero_means})")


def one_of(*choices, note: str = "") -> Check:
    return Check(lambda v: v in choices, f"must be one of {list(choices)}{note}")


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False,
           text: str | None = None) -> Check:
    """A number in [low, high] (an open end excludes its bound); `text` words the range ("≥ 0", "in [0, 1)")."""

    def test(value) -> bool:
        if not is_number(value) or not math.isfinite(value):
            return False
        above = low is None or (value > low if low_open else value >= low)
        below = high is None or (value < high if high_open else value <= high)
        return above and below

    return Check(test, f"must be {text}")


def setting(default=NOT_SET, doc: str = "", check: Check | None = None, *, factory: Callable | None = None,
            example: str = ""):
    """A section's field: its default (or a factory for lists and dicts), its doc for the key table and
    the check its value must pass; a setting without a default (one the user must give) has an `example`
    of it, as written on the command line."""
    metadata = {"doc": doc, "check": check, "example": example}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    if default is NOT_SET:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class Section:
    """Base of the config sections: checks every field, then `check()`, then seals the object."""

    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check, value = field.metadata.get("check"), getattr(self, field.name)
            if dataclasses.is_dataclass(value):
                continue  # a nested section checks itself when it is built
            if check is not None and not check(value):
                raise ConfigError(check.refusal(f"{self.PREFIX}.{field.name}", value))
        self.check()
        object.__setattr__(self, "_sealed", True)

    def check(self) -> None:
        """What spans several of the section's fields (raise ConfigError); nothing by default."""

    def __setattr__(self, name: str, value) -> None:
        if getattr(self, "_sealed", False):
            raise AttributeError(f"{self.PREFIX}.{name} is read-only once the config is resolved")
        object.__setattr__(self, name, value)

    @classmethod
    def needed(cls, name: str, choice: str, command: str = "python -m train") -> str:
        """The refusal of a command line that leaves field `name` unset, where `choice` (a group's choice, such
        as data=files) asks for it: what it is and an example of `command` with it."""
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        example = field.metadata.get("example")
        return (f"{choice} needs {cls.PREFIX}.{name}: {field.metadata.get('doc')}"
                + (f"; e.g. {command} {choice} {example}" if example else ""))

    @classmethod
    def must(cls, name: str) -> str | None:
        """What a valid value of field `name` is ("must be …"), or None when it has no check."""
        check = next((f.metadata.get("check") for f in dataclasses.fields(cls) if f.name == name), None)
        return None if check is None else check.must


def nested_section(field) -> type | None:
    """The section a field holds as a section of its own (train.batch_ramp, logging.wandb, plan.device), or None."""
    factory = field.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None


def describe_default(field) -> str:
    """A section field's default as the table writes it ("(required)" for a setting without one)."""
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    elif field.default is dataclasses.MISSING:
        return "(required)"
    else:
        value = field.default
    return shown(value)


def shown(value) -> str:
    """A default value as the settings table and the commands' help write it."""
    if value is None:
        return "null"
    if value == "???":  # omegaconf's MISSING
        return "(required)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`" if value.strip() == value else f"`{value!r}`"
    if isinstance(value, int) and abs(value) >= 1_000_000:
        return f"{value:,}"
    return str(value)
