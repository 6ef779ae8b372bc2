"""Zero- and few-shot evaluation as in the GPT-3 paper, at any layout (docs/evaluation.md).

  items.py       the shape every task shares: (context, continuation) requests and the gold one
  formats.py     each task's published record form → items, with lm-eval's prompts
  tasks.py       the task table (family, splits, Hub copy) and loading (bad records skipped, counted)
  fewshot.py     k-shot prompts from the task's own train or dev split, with a fixed seed
  requests.py    text → tokens as lm-eval splits them; left truncation to model.seq_len, counted
  scorer.py      log-likelihoods at any layout: batched by length, shared contexts encoded once
  task_metrics.py  acc, acc_norm (per character), last-word acc and perplexity
  suite.py       prepare_tasks once, then evaluate_tasks → {"eval/<task>/<metric>": value}
  references.py  the paper's zero-shot figures per task and model size (Table H.1)
  lm_eval_model.py  gpt3d as an lm-evaluation-harness model, "gpt3d" (python -m train.harness)
  sample.py      text from the model at its layout: the end-of-run sample and python -m train.generate
"""

from train.evaluation.suite import PreparedTask, TaskResult, evaluate_tasks, prepare_tasks, score_tasks
from train.evaluation.tasks import TASKS, TaskError

__all__ = [
    "PreparedTask", "TASKS", "TaskError", "TaskResult", "evaluate_tasks", "prepare_tasks", "score_tasks",
]
