"""`python -m train.export <checkpoint> <out_dir>`: a gpt3d checkpoint as a Hugging Face GPT-2 folder.

    python -m train.export runs/toy/2026-01-01_12-00-00/checkpoints hf/toy     # its newest intact checkpoint
    python -m train.export runs/toy/.../checkpoints/step00000200 hf/toy-200    # one checkpoint

The conversion, and the import that train.init_from uses, are train/checkpoint/hugging_face.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from train.checkpoint.hugging_face import ExportError, export
from train.config.entry import EXIT_BAD_INPUT


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print("usage: python -m train.export <checkpoint> <out_dir>\n  <checkpoint>: a run's checkpoints/ folder "
              "(its newest intact checkpoint) or one step folder", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        folder = export(Path(argv[0]), Path(argv[1]))
    except ExportError as err:
        print(f"gpt3d: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"exported {folder} to {argv[1]} (transformers: GPT2LMHeadModel.from_pretrained({argv[1]!r}))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
