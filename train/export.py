"""`python -m train.export <checkpoint> <out_dir>`: a gpt3d checkpoint as a Hugging Face GPT-2 folder.

    python -m train.export runs/toy/2026-01-01_12-00-00/checkpoints hf/toy     # its newest intact checkpoint
    python -m train.export runs/toy/.../checkpoints/step00000200 hf/toy-200    # one checkpoint

The conversion, and the import that train.init_from uses, are train/checkpoint/hugging_face.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from train.config.entry import EXIT_BAD_INPUT
from train.config.usage import Help, answer_help

USAGE = "python -m train.export CHECKPOINT OUT_DIR"


def command_help() -> Help:
    """What `python -m train.export --help` says."""
    return Help(
        usage=(USAGE,),
        purpose="Writes a run's checkpoint, whatever layout trained it, as a Hugging Face GPT-2 folder "
                "(GPT2LMHeadModel, its config and the GPT-2 tokenizer's files), which transformers loads and "
                "train.init_from starts a new run from.",
        settings_title="arguments",
        settings=(("CHECKPOINT", "a run folder, its checkpoints/ folder (its newest intact checkpoint) or one step "
                                 "folder"),
                  ("OUT_DIR", "the folder to write (new, or empty)")),
        examples=("python -m train.export runs/toy/2026-01-01_12-00-00/checkpoints hf/toy",
                  "python -m train.export runs/toy/2026-01-01_12-00-00/checkpoints/step00000200 hf/toy-200"),
        more="what is exported and what cannot be: docs/checkpoints.md",
    )


def main(argv: list[str]) -> int:
    answer_help(argv, command_help)
    if len(argv) != 2:
        print(f"gpt3d: error: {USAGE} takes two arguments, not {len(argv)} (python -m train.export --help)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    from train.checkpoint.hugging_face import ExportError, export

    try:
        folder = export(Path(argv[0]), Path(argv[1]))
    except ExportError as err:
        print(f"gpt3d: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"exported {folder} to {argv[1]} (transformers: GPT2LMHeadModel.from_pretrained({argv[1]!r}))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
