"""`python -m train.harness`: lm-evaluation-harness's own command line, with gpt3d registered as the
model "gpt3d" (train/evaluation/lm_eval_model.py), at any layout under torchrun.

    python -m train.harness --model gpt3d --model_args checkpoint=runs/toy/2026-01-01_12-00-00 --tasks lambada_openai
    torchrun --nproc_per_node 4 -m train.harness --model gpt3d --model_args checkpoint=...,tp=2,pp=2 --tasks piqa

lm-eval (0.4.13) finds models only in its own registry and its `lm_eval` console script imports none of
gpt3d's code, so `lm_eval --model gpt3d` cannot find the model: this command is the way in. Every argument
is lm_eval's (`lm_eval --help`); without --model it is gpt3d. Needs the `eval` extra (pip install -e ".[eval]").
"""

from __future__ import annotations

import sys

from train.config.entry import quiet_library_warnings
from train.config.usage import Help, answer_help

MODEL = "gpt3d"
OTHER_SUBCOMMANDS = ("ls", "validate")  # lm_eval's subcommands besides run


def command_help() -> Help:
    """What `python -m train.harness --help` says."""
    return Help(
        usage=("python -m train.harness [--model gpt3d] --model_args checkpoint=RUN[,KEY=VALUE...] --tasks TASK "
               "[lm_eval's arguments]",
               "torchrun --nproc_per_node N -m train.harness --model_args checkpoint=RUN,tp=T,pp=P [...]"),
        purpose="Runs lm-evaluation-harness with a trained run's checkpoint as its model \"gpt3d\", at any layout: any "
                "lm-eval task, its own or a local task YAML (--include_path FOLDER). `lm_eval --model gpt3d` cannot "
                "work (lm-eval finds no model of another package): use this command. Every other argument is "
                "lm_eval's own (lm_eval --help).",
        settings_title="model arguments (--model_args key=value,...)",
        settings=(("checkpoint", "a run directory, its checkpoints/ folder or one step folder; the model's shape is "
                                 "the checkpoint's (required)"),
                  ("tp, pp", "the layout to score at; dp is what the launch leaves (default: 1, 1)"),
                  ("batch_tokens", "input tokens per forward pass; lm-eval's --batch_size is not used (default: 8192)"),
                  ("device", "auto, cpu, cuda; lm-eval's --device cuda:N means each rank's GPU (default: auto)"),
                  ("precision", "auto, fp32, bf16 (default: auto)"),
                  ("seed, max_gen_toks", "sampling seed; the longest generation (default: 1234, 256)")),
        examples=("python -m train.harness --model_args checkpoint=runs/toy/2026-01-01_12-00-00 --tasks lambada_openai",
                  "python -m train.harness --model_args checkpoint=runs/toy/2026-01-01_12-00-00 --include_path tasks "
                  "--tasks my_lambada --device cpu"),
        more="a local task YAML, the request types and how gpt3d answers them: docs/evaluation.md#lm-evaluation-harness",
    )


def with_model(argv: list[str]) -> list[str]:
    """lm_eval's arguments as its `run` subcommand takes them, with --model gpt3d added when no model is named
    (lm_eval's own default is hf); its other subcommands (ls, validate) as they are."""
    if argv[:1] and argv[0] in OTHER_SUBCOMMANDS:
        return argv
    rest = argv[1:] if argv[:1] == ["run"] else argv
    named = any(arg == "--model" or arg.startswith("--model=") for arg in rest)
    return ["run", *rest] if named else ["run", "--model", MODEL, *rest]


def main() -> None:
    quiet_library_warnings()
    from lm_eval.__main__ import cli_evaluate

    import train.evaluation.lm_eval_model  # noqa: F401 (registers "gpt3d" with lm-eval)
    from train.runtime.process_group import shutdown_distributed

    cli_evaluate()
    shutdown_distributed()


if __name__ == "__main__":
    answer_help(sys.argv[1:] or ["--help"], command_help)
    sys.argv = ["lm_eval", *with_model(sys.argv[1:])]
    main()
