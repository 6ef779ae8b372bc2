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
from train.monitor.charts import FILE_NAME, CurvesError, draw


def main(argv: list[str]) -> int:
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
