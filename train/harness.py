"""`python -m train.harness`: lm-evaluation-harness's own command line, with gpt3d registered as the
model "gpt3d" (train/evaluation/lm_eval_model.py), at any layout under torchrun.

    python -m train.harness --model gpt3d --model_args checkpoint=runs/toy/2026-01-01_12-00-00 --tasks lambada_openai
    torchrun --nproc_per_node 4 -m train.harness --model gpt3d --model_args checkpoint=...,tp=2,pp=2 --tasks piqa

Every argument is lm_eval's (`lm_eval run --help`); needs the `eval` extra (pip install -e ".[eval]").
"""

from __future__ import annotations

import sys

from train.config.entry import quiet_library_warnings


def main() -> None:
    quiet_library_warnings()
    from lm_eval.__main__ import cli_evaluate

    import train.evaluation.lm_eval_model  # noqa: F401 (registers "gpt3d" with lm-eval)
    from train.runtime.process_group import shutdown_distributed

    cli_evaluate()
    shutdown_distributed()


if __name__ == "__main__":
    sys.argv[0] = "lm_eval"
    main()
