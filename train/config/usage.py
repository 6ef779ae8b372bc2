"""`python -m train --help`: what the command takes, in its own words rather than Hydra's generic help.

The choices of each group are read from the config folder, so the text lists what exists; the groups
of the other commands (`generate`, `plan`) and the typed schemas the data group files start from are
left out.
"""

from __future__ import annotations

from train.config.entry import CONFIG_DIR

GROUPS = {"model": "model=", "data": "data=", "deepspeed": "deepspeed=", "recipe": "+recipe="}  # group → how it is set
SECTIONS = ("model", "train", "optim", "parallel", "data", "logging")


def train_usage() -> str:
    """The help text of `python -m train`."""
    groups = "\n".join(f"  {written}{'|'.join(_choices(group))}" for group, written in GROUPS.items())
    return f"""usage: python -m train [GROUP=CHOICE ...] [KEY=VALUE ...]
       torchrun --nproc_per_node N -m train [...]

Trains a GPT-3-shaped model: by default the 7M-parameter toy on this machine's CPU, on Python's
standard library, for a few minutes. Each run writes into its run folder (runs/<model>/<date_time>/,
or hydra.run.dir=PATH): metrics.jsonl, checkpoints/, curves.png, an offline W&B run; the same command
with the same run folder resumes it.

groups (one choice each):
{groups}

settings, KEY=VALUE: {', '.join(f'{name}.*' for name in SECTIONS)}
  (every key, its meaning, default and check: docs/configuration.md)

examples:
  python -m train data=files 'data.paths=[input.txt]'             # train on your own text file
  python -m train model=gpt3-125m train.max_steps=5000 optim.lr=6e-4
  python -m train train.max_steps=400 hydra.run.dir=runs/mine     # run it again to resume
  python -m train --cfg job                                       # print the composed config

other commands: python -m train.generate (text from a checkpoint), python -m train.curves (a run's
curves as a PNG), python -m train.plan (memory and speed of a layout), python -m train.export (to
Hugging Face), python -m train.prepare_data (tokenize a corpus once)."""


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
