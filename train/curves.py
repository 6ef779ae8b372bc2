"""`python -m train.curves RUN_DIR [RUN_DIR ...] [--out FILE]`: the curves of one or more runs as a PNG.

    python -m train.curves runs/toy/2026-01-01_12-00-00          # → runs/toy/2026-01-01_12-00-00/curves.png
    python -m train.curves runs/a runs/b --out compare.png        # two runs, one colour each

Training and validation loss, learning rate, tokens/s and gradient norm against tokens seen, read from
each folder's metrics.jsonl (train/monitor/charts.py; matplotlib, the `curves` extra). Prints the PNG's path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.config.entry import EXIT_BAD_INPUT
from train.config.usage import Help, answer_help
from train.monitor.charts import FILE_NAME, CurvesError, draw


def command_help() -> Help:
    """What `python -m train.curves --help` says."""
    return Help(
        usage=("python -m train.curves RUN_DIR [RUN_DIR ...] [--out FILE]",),
        purpose="Draws the curves of one or more runs into a PNG and prints its path: training and validation loss, "
                "learning rate, tokens/s and gradient norm against tokens seen, from each run folder's metrics.jsonl. "
                "Several runs get one colour each, labelled by their folder's name and the settings in which they "
                "differ.",
        settings_title="arguments",
        settings=(("RUN_DIR", "a run folder, holding metrics.jsonl (one or more)"),
                  ("--out FILE", f"the PNG to write (default: RUN_DIR/{FILE_NAME} for one run, ./{FILE_NAME} for "
                                 "several)")),
        examples=("python -m train.curves runs/toy/2026-01-01_12-00-00",
                  "python -m train.curves runs/lr-3e-3 runs/lr-1e-3 --out compare.png"),
        more="what the PNG holds (its numbers too, readable back): docs/configuration.md#outputs-and-monitoring",
    )


def main(argv: list[str]) -> int:
    answer_help(argv, command_help)
    parser = argparse.ArgumentParser(prog="python -m train.curves", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="a run folder (holding metrics.jsonl)")
    parser.add_argument("--out", type=Path, help=f"the PNG to write (default: RUN_DIR/{FILE_NAME} for one run, "
                                                 f"./{FILE_NAME} for several)")
    args = parser.parse_args(argv)
    out = args.out or (args.runs[0] / FILE_NAME if len(args.runs) == 1 else Path(FILE_NAME))
    try:
        print(draw(args.runs, out))
    except CurvesError as err:
        print(f"gpt3d curves: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
