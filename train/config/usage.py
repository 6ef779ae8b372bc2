"""Every command's `--help`, in one shape and in gpt3d's own words, never Hydra's or argparse's generic help:
how it is called, what it does, its own settings or arguments (each with its meaning and default), two
examples, and where the details are.

A command answers `--help` (or `-h`) before it imports anything heavy: `answer_help(argv, Help(...))`
prints the text and exits 0. The settings of a command that takes KEY=VALUE overrides come from its
section's fields (`section_settings`), so the help lists what the code reads.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Callable

from train.config.entry import CONFIG_DIR
from train.config.settings import Section, describe_default, nested_section

HELP_FLAGS = ("--help", "-h")
WIDTH = 100  # the text's width
KEY_WIDTH = 30  # the settings' first column

GROUPS = {"model": "model=", "data": "data=", "deepspeed": "deepspeed=", "recipe": "+recipe="}  # group → how it is set
SECTIONS = ("model", "train", "optim", "parallel", "data", "logging")
COMMANDS = (  # every command but python -m train, one line each
    ("python -m train.evaluate", "score a checkpoint on GPT-3's zero- and few-shot tasks"),
    ("python -m train.harness", "lm-evaluation-harness with gpt3d as its model (not `lm_eval --model gpt3d`)"),
    ("python -m train.generate", "text from a checkpoint"),
    ("python -m train.plan", "memory, speed and days of a layout; the fastest layout that fits"),
    ("python -m train.curves", "the curves of one or more runs as a PNG"),
    ("python -m train.export", "a checkpoint as a Hugging Face GPT-2 folder"),
    ("python -m train.prepare_data", "tokenize a corpus once, for data=prepared"),
)


@dataclass(frozen=True)
class Help:
    """What a command's --help says (see the module docstring)."""

    usage: tuple[str, ...]  # how it is called, one line each
    purpose: str  # what it does (wrapped)
    settings_title: str  # e.g. "settings (KEY=VALUE)", "arguments"
    settings: tuple[tuple[str, str], ...]  # (key or argument, its meaning and default)
    examples: tuple[str, ...]  # two, as typed
    more: str  # where the details are

    def text(self) -> str:
        lines = [f"usage: {self.usage[0]}", *(f"       {line}" for line in self.usage[1:]), ""]
        lines += textwrap.wrap(self.purpose, WIDTH) + ["", f"{self.settings_title}:"]
        for key, meaning in self.settings:
            wrapped = textwrap.wrap(meaning, WIDTH - KEY_WIDTH - 2) or [""]
            first = f"  {key:<{KEY_WIDTH - 2}}" if len(key) < KEY_WIDTH - 2 else f"  {key}\n{' ' * KEY_WIDTH}"
            lines.append(first + wrapped[0])
            lines += [" " * KEY_WIDTH + line for line in wrapped[1:]]
        lines += ["", "examples:", *(f"  {example}" for example in self.examples), "", self.more]
        return "\n".join(lines)


def section_settings(section: type[Section]) -> tuple[tuple[str, str], ...]:
    """(KEY, its doc and default) for every field of a section (a nested section's fields, prefixed)."""
    rows = []
    for field in dataclasses.fields(section):
        inner = nested_section(field)
        if inner is not None:
            nested = section_settings(inner)
            rows += [(f"{section.PREFIX}.{field.name}.{key.rpartition('.')[2]}", meaning) for key, meaning in nested]
            continue
        rows.append((f"{section.PREFIX}.{field.name}", f"{field.metadata.get('doc', '')} (default: "
                                                        f"{describe_default(field).strip('`')})"))
    return tuple(rows)


def answer_help(argv: list[str], command_help: Callable[[], Help]) -> None:
    """When `argv` asks for help (--help or -h), print `command_help()`'s text and exit 0; otherwise nothing."""
    if set(HELP_FLAGS) & set(argv):
        print(command_help().text())
        raise SystemExit(0)


def train_help() -> Help:
    """The help of `python -m train`."""
    groups = tuple((written + "|".join(_choices(group)), "one choice of configs/" + group + "/")
                   for group, written in GROUPS.items())
    sections = (", ".join(f"{name}.*" for name in SECTIONS),
                "every key, its meaning, default and check: docs/configuration.md")
    return Help(
        usage=("python -m train [GROUP=CHOICE ...] [KEY=VALUE ...]", "torchrun --nproc_per_node N -m train [...]"),
        purpose="Trains a GPT-3-shaped model: by default the 7M-parameter toy on this machine's CPU, on the prose "
                "of Python's standard-library docstrings, for a few minutes. Each run writes into its run folder "
                "(runs/<model>/<date_time>/, or hydra.run.dir=PATH): metrics.jsonl, checkpoints/, curves.png, an "
                "offline W&B run; the same command with the same run folder resumes it.",
        settings_title="groups and settings",
        settings=(*groups, sections),
        examples=("python -m train data=files 'data.paths=[input.txt]'           # train on your own text file",
                  "python -m train train.max_steps=400 hydra.run.dir=runs/mine   # run it again to resume"),
        more="other commands (each answers --help):\n" + "\n".join(f"  {name:<29}{what}" for name, what in COMMANDS),
    )


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
