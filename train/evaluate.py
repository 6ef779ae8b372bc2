"""`python -m train.evaluate`: GPT-3's zero- and few-shot tasks on a trained run's weights, at any layout.

    python -m train.evaluate evaluate.checkpoint=runs/toy/2026-01-01_12-00-00 'evaluate.tasks=[lambada,hellaswag]' \\
        evaluate.data_dir=evals
    torchrun --nproc_per_node 4 -m train.evaluate parallel.tp=2 parallel.pp=2 evaluate.checkpoint=... evaluate.num_fewshot=5

The config is the training one (model.* must be the run's; parallel.* is the layout to score at,
whatever the run trained at; train.device, train.seed, train.precision) plus the `evaluate` group
(train/config/sections/evaluate.py). Every check runs before any model is
built: the values, the tasks and their files (train/evaluation/tasks.py), the checkpoint's model
shape; each refusal is one line and exit code 2. Malformed records skipped and requests cut to
model.seq_len are counted in one line per task. Rank 0 prints each metric beside the paper's figure
for the same task and model size (train/evaluation/references.py) and writes the metrics and every
request's log-likelihood as JSON to evaluate.output if set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from train.config.entry import (
    CONFIG_DIR,
    EXIT_BAD_INPUT,
    drop_launcher_arguments,
    quiet_library_warnings,
    register_config,
)
from train.config.sections import Sections
from train.config.sections.evaluate import EvaluateConfig
from train.config.usage import Help, answer_help, section_settings

if TYPE_CHECKING:
    import torch

    from model import GPTConfig
    from train.runtime.resolve import Runtime


def command_help() -> Help:
    """What `python -m train.evaluate --help` says."""
    return Help(
        usage=("python -m train.evaluate evaluate.checkpoint=RUN [KEY=VALUE ...]",
               "torchrun --nproc_per_node N -m train.evaluate parallel.tp=T parallel.pp=P [...]"),
        purpose="Scores a trained run's checkpoint on GPT-3's zero- and few-shot tasks (LAMBADA, HellaSwag, PIQA, "
                "ARC, StoryCloze, COPA, Winogrande) at any layout, and prints each metric beside the paper's figure. "
                "The tasks' data comes from local files, evaluate.data_dir=DIR holding DIR/<task>/<split>.jsonl, or "
                "from the Hugging Face Hub (which needs the network). The model is the run's (model.*, or "
                "model=NAME); parallel.*, train.device, train.seed and train.precision are training's.",
        settings_title="settings (KEY=VALUE)",
        settings=section_settings(EvaluateConfig),
        examples=("python -m train.evaluate evaluate.checkpoint=runs/toy/2026-01-01_12-00-00 evaluate.data_dir=evals",
                  "python -m train.evaluate evaluate.checkpoint=runs/toy/2026-01-01_12-00-00 evaluate.data_dir=evals "
                  "'evaluate.tasks=[lambada,piqa]' evaluate.num_fewshot=5"),
        more="the tasks, their files' forms and the scoring rules: docs/evaluation.md",
    )


def resolve(cfg: DictConfig) -> tuple[Sections, Runtime, GPTConfig, EvaluateConfig, Path]:
    """The evaluate command's resolve: every value of the config checked; returns the sections, the runtime
    (device and precision), the model config, the evaluate section and the checkpoint folder."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from train.checkpoint import tag_folder
    from train.config.settings import ConfigError
    from train.run.checks import check_keys, check_model, check_parallel, check_runtime

    check_keys(cfg, "evaluate", list(HydraConfig.get().overrides.task))
    sections, settings = Sections.of(cfg), OmegaConf.to_object(cfg.evaluate)
    runtime = check_runtime(sections.train)
    model_cfg = check_model(OmegaConf.to_container(cfg.model, resolve=True))
    check_parallel(sections.parallel, model_cfg, {})
    if settings.checkpoint is None:
        raise ConfigError("evaluate.checkpoint is not set: give a run directory, its checkpoints/ folder or one step folder")
    try:
        return sections, runtime, model_cfg, settings, tag_folder(Path(settings.checkpoint))
    except ValueError as err:
        raise ConfigError(f"evaluate.checkpoint: {err}") from None


def counts(tasks, seq_len: int) -> list[str]:
    """One line per task that skipped malformed records or cut requests to the model's window."""
    lines = []
    for task in tasks:
        if task.skipped:
            lines.append(f"gpt3d: warning: {task.name}: {task.skipped} malformed record(s) of {task.source} skipped")
        if task.truncated:
            lines.append(f"gpt3d: warning: {task.name}: {task.truncated} request(s) longer than model.seq_len={seq_len} "
                         "truncated from the left")
    return lines


def run(sections: Sections, runtime: Runtime, model_cfg: GPTConfig, settings: EvaluateConfig, tasks,
        weights: dict[str, torch.Tensor]):
    """Build this rank's part at the parallel section's layout, give it its slices of `weights`, score the tasks."""
    from train.checkpoint.model_part import model_part
    from train.evaluation import score_tasks
    from train.runtime.process_group import shutdown_distributed

    parallel = sections.parallel
    part, topology = model_part(weights, model_cfg, parallel.tp, parallel.pp, runtime, sections.train.seed,
                                parallel.sequence_parallel)
    results = score_tasks(part, model_cfg, topology, tasks, settings.batch_tokens, runtime.bf16_products)
    layout = {"tp": topology.tp_size, "pp": topology.pp_size, "dp": topology.dp_size, "rank": topology.rank}
    shutdown_distributed()
    return results, layout


def table(results, model_cfg: GPTConfig, fewshot: int) -> str:
    """The metrics (acc in percent) beside the paper's zero-shot figure for the same task and size."""
    from train.evaluation.references import TABLE, paper_size, reference

    size = paper_size(model_cfg.n_layer, model_cfg.d_model) if fewshot == 0 else None
    paper = f"GPT-3 {size} ({TABLE})" if size else "GPT-3 (no zero-shot figure for this shape and setting)"
    lines = [f"{'task':<14} {'metric':<9} {'value':>9}   {paper}"]
    for result in results:
        for metric, value in result.metrics.items():
            shown = value if metric == "ppl" else 100 * value
            figure = reference(result.task.name, metric, size)
            lines.append(f"{result.task.name:<14} {metric:<9} {shown:>9.2f}   {'' if figure is None else figure}")
    return "\n".join(lines)


def record(results, settings: EvaluateConfig, folder: Path, layout: dict) -> dict:
    return {
        "checkpoint": str(folder), "num_fewshot": settings.num_fewshot, "fewshot_seed": settings.fewshot_seed,
        "layout": {key: layout[key] for key in ("tp", "pp", "dp")},
        "tasks": {r.task.name: {
            "metrics": r.metrics, "items": len(r.task.items), "skipped": r.task.skipped,
            "truncated": r.task.truncated, "source": r.task.source,
            "loglikelihoods": [[s.logprob for s in scores] for scores in r.scores],
            "greedy": [[s.greedy for s in scores] for scores in r.scores],
        } for r in results},
    }


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from train.checkpoint.model_part import checkpoint_weights
    from train.config.launch import is_rank_zero
    from train.config.settings import ConfigError
    from train.evaluation import TaskError, prepare_tasks
    from train.monitor.metrics import write_atomically

    try:
        sections, runtime, model_cfg, settings, folder = resolve(cfg)
        tasks = prepare_tasks(settings, model_cfg.seq_len)
        weights = checkpoint_weights(folder, model_cfg)
    except (ConfigError, TaskError) as err:
        print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    if is_rank_zero():
        for line in counts(tasks, model_cfg.seq_len):
            print(line, file=sys.stderr, flush=True)
    results, layout = run(sections, runtime, model_cfg, settings, tasks, weights)
    if layout["rank"] == 0:
        print(table(results, model_cfg, settings.num_fewshot), flush=True)
        if settings.output is not None:
            write_atomically(Path(settings.output), json.dumps(record(results, settings, folder, layout)) + "\n")


if __name__ == "__main__":
    sys.argv = drop_launcher_arguments(sys.argv)
    answer_help(sys.argv[1:], command_help)
    register_config()
    quiet_library_warnings()
    main()
