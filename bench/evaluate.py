"""Scoring speed: multiple-choice items per second, gpt3d against lm-eval's own `hf` model on the
exported Hugging Face folder of the same checkpoint, in one run.

    python -m bench.evaluate --checkpoint runs/toy/2026-01-01_12-00-00/checkpoints
    python -m bench.evaluate --checkpoint ... --items 400 --choices 4 --context 96 --ending 24 --json out.json
    python -m bench.evaluate --checkpoint ... --quick          # 16 items: a smoke run

The task is synthetic, shaped like HellaSwag (a context of `--context` words, `--choices` endings of
`--ending` words each), written once in ARC's record form, so both sides read the same records: lm-eval
through a local task YAML (ARC's prompt, multiple_choice), gpt3d also through its own `arc_easy` form.
Rows, each timed over the whole task after the models are built (median of `--repeats`):

  hf (lm-eval) *      lm-eval's HFLM (transformers GPT2LMHeadModel, float32, --hf-batch requests a batch):
                      the baseline
  gpt3d (lm-eval)     gpt3d as lm-eval's model "gpt3d" (train/evaluation/lm_eval_model.py), same evaluator
  gpt3d scorer        train.evaluation's own path (prepare_tasks + score_tasks), as python -m train.evaluate
                      and the training loop run it

`items/s` is items over seconds, `×` the baseline's time over the row's. All rows must agree on acc
and acc_norm (checked), so they did the same work. One process, one device: layouts do not enter.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

TASK = "bench_choice"
YAML = """task: bench_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {file}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices.text}}}}"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(folder: Path, items: int, choices: int, context: int, ending: int) -> Path:
    """The synthetic task as <folder>/arc_easy/test.jsonl (ARC's flat form) and <folder>/tasks/bench_choice.yaml."""
    import inspect
    import textwrap

    words = sorted(set(inspect.getsource(textwrap).split()))
    rng = random.Random(0)
    labels = "ABCDEFGH"[:choices]
    lines = []
    for _ in range(items):
        record = {"question": " ".join(rng.choices(words, k=context)),
                  "choices": {"text": [" ".join(rng.choices(words, k=ending)) for _ in labels], "label": list(labels)},
                  "answerKey": rng.choice(labels)}
        lines.append(json.dumps(record) + "\n")
    data = folder / "arc_easy" / "test.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(lines))
    (folder / "tasks").mkdir()
    (folder / "tasks" / f"{TASK}.yaml").write_text(YAML.format(file=data))
    return folder


def timed(run, repeats: int):
    """Median seconds of `run()` over `repeats` runs, and its last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a run's checkpoints/ folder or one step folder")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context", type=int, default=48, help="words of context")
    parser.add_argument("--ending", type=int, default=12, help="words per ending")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="gpt3d's input tokens per forward pass")
    parser.add_argument("--hf-batch", type=int, default=16, help="lm-eval hf's requests per batch")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="16 items")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.quick:
        args.items = 16
    if args.threads:
        torch.set_num_threads(args.threads)

    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from parallel.topology import Topology
    from train.checkpoint.hugging_face import export
    from train.config.sections.evaluate import EvaluateConfig
    from train.evaluation import prepare_tasks, score_tasks
    from train.evaluation.lm_eval_model import GPT3DLM

    work = Path(tempfile.mkdtemp(prefix="bench-evaluate-"))
    write_task(work, args.items, args.choices, args.context, args.ending)
    export(Path(args.checkpoint), work / "hf")
    manager = TaskManager(include_path=str(work / "tasks"), include_defaults=False)
    hf = HFLM(pretrained=str(work / "hf"), dtype="float32", device=args.device, batch_size=args.hf_batch)
    ours = GPT3DLM(checkpoint=args.checkpoint, device=args.device, precision="fp32", batch_tokens=args.batch_tokens)
    settings = EvaluateConfig(tasks=["arc_easy"], data_dir=str(work), batch_tokens=args.batch_tokens)

    def harness(lm):
        result = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, verbosity="WARNING")
        return {k.split(",")[0]: v for k, v in result["results"][TASK].items() if k in ("acc,none", "acc_norm,none")}

    def scorer():
        tasks = prepare_tasks(settings, ours.config.seq_len)
        (result,) = score_tasks(ours.part, ours.config, Topology.create(1, 1), tasks, args.batch_tokens)
        return result.metrics

    rows = {}
    for name, run in (("hf (lm-eval) *", lambda: harness(hf)), ("gpt3d (lm-eval)", lambda: harness(ours)),
                      ("gpt3d scorer", scorer)):
        rows[name] = timed(run, args.repeats)
    metrics = [result for _, result in rows.values()]
    if any(m["acc"] != metrics[0]["acc"] or m["acc_norm"] != metrics[0]["acc_norm"] for m in metrics):
        raise SystemExit(f"the rows disagree on the task's metrics: {metrics}")
    base = rows["hf (lm-eval) *"][0]
    threads = f", {torch.get_num_threads()} threads" if args.device == "cpu" else ""
    print(f"multiple choice, {args.items} items × {args.choices} endings ({args.context}-word context, {args.ending}-word "
          f"endings), GPT L={ours.config.n_layer} d={ours.config.d_model} seq_len={ours.config.seq_len}, "
          f"{args.device} float32{threads}, median of {args.repeats}; acc {metrics[0]['acc']:.3f}")
    print(f"{'row':<18}{'seconds':>9}{'items/s':>10}{'×':>7}")
    records = []
    for name, (seconds, _) in rows.items():
        print(f"{name:<18}{seconds:>9.2f}{args.items / seconds:>10.1f}{base / seconds:>7.2f}")
        records.append({"row": name, "seconds": seconds, "items_per_s": args.items / seconds, "ratio": base / seconds})
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
