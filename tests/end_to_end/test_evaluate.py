"""`python -m train.evaluate` and gpt3d as an lm-eval model, against lm-eval's own `hf` model on the
exported Hugging Face folder, at several layouts, and with bad input.

One tiny model trained once for the module (60 steps, so its choices are not uniform) and exported;
fixture tasks written here from standard-library source lines, in LAMBADA's and PIQA's published forms
(the LAMBADA file also holds two malformed lines and one passage longer than model.seq_len). lm-eval
reads the same records through local task YAMLs (its `json` loader, no network), as four tasks: the
last word (loglikelihood), multiple choice, the passages' rolling log-likelihood and greedy generation.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from cli import REPO, clean_env, evaluate, free_port, run_module, train

TRAIN = ["train.max_steps=60", "train.micro_batch_size=4", "optim.lr=1e-2", "optim.decay_tokens=1000000",
         "train.eval_interval=0", "train.checkpoint_interval=60", "logging.wandb.mode=disabled"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TASKS = ["gpt3d_lambada", "gpt3d_piqa", "gpt3d_rolling", "gpt3d_generate"]
LAST_WORD = "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\ndoc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
YAMLS = {  # lm-eval task YAMLs over the fixture files: lambada_openai's and piqa's definitions, local
    "gpt3d_lambada": "output_type: loglikelihood\n" + LAST_WORD
    + "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n  - metric: acc\n",
    "gpt3d_piqa": "output_type: multiple_choice\ndoc_to_text: \"Question: {{goal}}\\nAnswer:\"\ndoc_to_target: label\n"
    "doc_to_choice: \"{{[sol1, sol2]}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    "gpt3d_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
    "metric_list:\n  - metric: word_perplexity\n",
    "gpt3d_generate": "output_type: generate_until\n" + LAST_WORD
    + "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
}


def source_lines() -> list[str]:
    """Short standard-library source lines of three words or more, in a fixed order."""
    import argparse, csv, json as js, logging, pathlib, string, textwrap  # noqa: E401

    lines = [line.rstrip() for module in (argparse, csv, js, logging, pathlib, string, textwrap)
             for _, fn in inspect.getmembers(module, inspect.isfunction) if fn.__module__ == module.__name__
             for line in inspect.getsource(fn).splitlines() if len(line.split()) >= 3 and len(line) < 60]
    return lines[::4]


@pytest.fixture(scope="module")
def fixture(tmp_path_factory, corpus):
    """(run dir, exported folder, data dir, lm-eval task dir) of the module's model and tasks."""
    root = tmp_path_factory.mktemp("evaluate")
    train(root / "run", corpus, *TRAIN)
    exported = run_module("train.export", [str(root / "run" / "checkpoints"), str(root / "hf")])
    assert exported.returncode == 0, exported.stderr[-3000:]
    lines = source_lines()
    passages = [{"text": line} for line in lines[:12]] + [{"text": " ".join(lines[30:40])}]  # the last one: > seq_len
    pieces = [line.strip().split(" ", 1) for line in lines[12:24]]
    choices = [{"goal": goal, "sol1": rest if i % 2 == 0 else pieces[i - 1][1],
                "sol2": pieces[i - 1][1] if i % 2 == 0 else rest, "label": i % 2} for i, (goal, rest) in enumerate(pieces)]
    data, clean = root / "data", root / "clean"
    for folder, extra in ((data, ["{not json", '{"txt": "no text field"}']), (clean, [])):
        (folder / "lambada").mkdir(parents=True)
        (folder / "piqa").mkdir()
        (folder / "lambada" / "test.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages[:6])
                                                       + "".join(e + "\n" for e in extra)
                                                       + "".join(json.dumps(p) + "\n" for p in passages[6:]))
        (folder / "piqa" / "validation.jsonl").write_text("".join(json.dumps(c) + "\n" for c in choices))
    tasks = root / "tasks"
    tasks.mkdir()
    for name, body in YAMLS.items():
        split = "validation" if name == "gpt3d_piqa" else "test"
        file = clean / ("piqa/validation.jsonl" if name == "gpt3d_piqa" else "lambada/test.jsonl")
        (tasks / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                            f"    {split}: {file}\n{split}_split: {split}\n{body}")
    return root / "run", root / "hf", data, tasks


def scores(out) -> dict:
    return json.loads(out.read_text())["tasks"]


@pytest.fixture(scope="module")
def one_process(fixture, tmp_path_factory):
    """python -m train.evaluate in one process: its JSON and its stderr."""
    run_dir, _, data, _ = fixture
    out = tmp_path_factory.mktemp("one") / "out.json"
    proc = evaluate(run_dir, "evaluate.tasks=[lambada,piqa]", f"evaluate.data_dir={data}", f"evaluate.output={out}",
                    "evaluate.batch_tokens=64")
    return scores(out), proc


@pytest.fixture(scope="module")
def hf_reference(fixture):
    """lm-eval's own `hf` model on the exported folder, through lm-eval's Python API (batch 1, fp32)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    _, hf, _, tasks = fixture
    with pytest.MonkeyPatch.context() as patch:
        for key, value in OFFLINE.items():
            patch.setenv(key, value)
        result = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(hf), "dtype": "float32"},
                                         tasks=TASKS, task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                         log_samples=True, device="cpu", batch_size=1)
    return result["results"], result["samples"]


def responses(samples: list[dict]) -> list[list]:
    """Each document's responses (log-likelihood with greedy flag, rolling log-likelihood or text), by doc_id."""
    return [[r[0] for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]


def loglikelihood(response) -> float:
    """The log-likelihood of a response; lm-eval's sample files write numbers as strings."""
    return float(response[0] if isinstance(response, (list, tuple)) else response)


def test_evaluate_counts_bad_records_and_cut_contexts_and_equals_lm_eval_hf(one_process, hf_reference):
    ours, proc = one_process
    results, samples = hf_reference
    assert "lambada: 2 malformed record(s) of" in proc.stderr
    assert "lambada: 1 request(s) longer than model.seq_len=32 truncated from the left" in proc.stderr
    assert ours["lambada"]["skipped"] == 2 and ours["lambada"]["truncated"] == 1 and ours["lambada"]["items"] == 13
    for task, theirs in (("lambada", "gpt3d_lambada"), ("piqa", "gpt3d_piqa")):
        expected = responses(samples[theirs])
        got = [[[ll, greedy] for ll, greedy in zip(lls, flags)]
               for lls, flags in zip(ours[task]["loglikelihoods"], ours[task]["greedy"])]
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert [ll for ll, _ in g] == pytest.approx([ll for ll, _ in e], abs=1e-4)
            assert [flag for _, flag in g] == [flag for _, flag in e]
    assert ours["piqa"]["metrics"]["acc"] == results["gpt3d_piqa"]["acc,none"]
    assert ours["piqa"]["metrics"]["acc_norm"] == results["gpt3d_piqa"]["acc_norm,none"]
    assert ours["lambada"]["metrics"]["acc"] == results["gpt3d_lambada"]["acc,none"]
    assert ours["lambada"]["metrics"]["ppl"] == pytest.approx(results["gpt3d_lambada"]["perplexity,none"], rel=1e-4)
    assert 0 < ours["piqa"]["metrics"]["acc"] < 1  # the model prefers some endings: the comparison has teeth
    assert "piqa" in proc.stdout and "acc_norm" in proc.stdout


@pytest.mark.parametrize("layout, nproc", [(["parallel.tp=2"], 2), (["parallel.pp=2"], 4),
                                           (["parallel.tp=2", "parallel.pp=2"], 4)], ids=["tp2", "pp2-dp2", "tp2-pp2"])
def test_evaluate_at_any_layout_equals_one_process(fixture, one_process, tmp_path, layout, nproc):
    run_dir, _, data, _ = fixture
    out = tmp_path / "out.json"
    evaluate(run_dir, "evaluate.tasks=[lambada,piqa]", f"evaluate.data_dir={data}", f"evaluate.output={out}",
             "evaluate.batch_tokens=64", *layout, kind="ranks", nproc=nproc)
    got, (expected, _) = scores(out), one_process
    for task in ("lambada", "piqa"):
        assert got[task]["metrics"] == pytest.approx(expected[task]["metrics"], rel=1e-5)
        for g, e in zip(got[task]["loglikelihoods"], expected[task]["loglikelihoods"]):
            assert g == pytest.approx(e, rel=1e-5, abs=1e-5)
        assert got[task]["greedy"] == expected[task]["greedy"]


def documented_task(data: Path) -> str:
    """docs/evaluation.md's local task YAML as written there, reading `data`'s LAMBADA file instead of evals/'s."""
    text = (REPO / "docs" / "evaluation.md").read_text()
    yaml = next(block for block in text.split("```yaml\n")[1:] if block.startswith("# tasks/my_lambada.yaml"))
    return yaml.split("```")[0].replace("evals/lambada/test.jsonl", str(data / "lambada" / "test.jsonl"))


def test_lm_eval_command_line_runs_gpt3d_on_local_tasks_as_hf_does(fixture, hf_reference, tmp_path):
    """python -m train.harness (gpt3d its default model) over the local YAMLs: loglikelihood, multiple
    choice, loglikelihood_rolling and generate_until, each response as lm-eval's hf model gives it; and
    docs/evaluation.md's local task, on the same file as gpt3d_lambada, scoring as it does."""
    run_dir, _, _, tasks = fixture
    results, samples = hf_reference
    (tasks / "my_lambada.yaml").write_text(documented_task(tasks.parent / "clean"))
    args = ["--model_args", f"checkpoint={run_dir}", "--tasks", *TASKS, "my_lambada", "--include_path", str(tasks),
            "--device", "cpu", "--log_samples", "--output_path", str(tmp_path / "lm_eval")]
    proc = run_module("train.harness", args, env=clean_env(OFFLINE))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "gpt3d_piqa" in proc.stdout and "acc_norm" in proc.stdout
    (results_file,) = (tmp_path / "lm_eval").rglob("results_*.json")
    ours = json.loads(results_file.read_text())["results"]
    assert ours["my_lambada"]["acc,none"] == ours["gpt3d_lambada"]["acc,none"]
    assert ours["my_lambada"]["perplexity,none"] == pytest.approx(ours["gpt3d_lambada"]["perplexity,none"], rel=1e-9)
    for task in TASKS:
        (file,) = (tmp_path / "lm_eval").rglob(f"samples_{task}_*.jsonl")
        got = responses([json.loads(line) for line in file.read_text().splitlines()])
        expected = responses(samples[task])
        if task == "gpt3d_generate":
            assert got == expected and any(text for (text,) in got)
        else:
            assert len(got) == len(expected)
            for g, e in zip(got, expected):  # (log-likelihood, greedy) pairs, or a rolling log-likelihood
                assert [loglikelihood(r) for r in g] == pytest.approx([loglikelihood(r) for r in e], abs=1e-4)
                assert [str(r[1]) for r in g if isinstance(r, (list, tuple))] == [
                    str(r[1]) for r in e if isinstance(r, (list, tuple))]
        for metric, value in results[task].items():
            if metric.endswith(",none") and "stderr" not in metric:
                assert ours[task][metric] == pytest.approx(value, rel=1e-4), (task, metric)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["evaluate.tasks=[lambda]"], "evaluate.tasks: unknown task 'lambda'; the tasks are ['arc_challenge'"),
        (["evaluate.tasks=[hellaswag]"], "hellaswag: no file "),
        (["model.d_model=64"], "holds another model: it was saved with model.d_model=32"),
        (["evaluate.num_fewshot=-1"], "evaluate.num_fewshot=-1: must be an integer ≥ 0"),
    ],
    ids=["unknown-task", "missing-file", "other-shape", "bad-value"],
)
def test_evaluate_refuses_bad_input_in_one_line_before_any_model_is_built(fixture, tmp_path, overrides, message):
    run_dir, _, data, _ = fixture
    out = tmp_path / "out.json"
    proc = evaluate(run_dir, f"evaluate.data_dir={data}", f"evaluate.output={out}", *overrides, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("gpt3d: error") == 1 and not out.exists()


def test_without_data_dir_and_without_the_hub_evaluate_names_the_local_files_in_one_line(fixture, tmp_path):
    """No evaluate.data_dir, and a Hub that refuses connections (HF_ENDPOINT: a closed local port; no network is
    reached): one line naming evaluate.data_dir and the files it would read, exit 2, no retries, no traceback."""
    run_dir, _, _, _ = fixture
    port = free_port()  # free a moment ago: nothing listens there
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": "", "HTTPS_PROXY": "",
           "https_proxy": "", "ALL_PROXY": "", "all_proxy": "",
           "HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "home")}
    proc = evaluate(run_dir, "evaluate.tasks=[hellaswag]", "evaluate.num_fewshot=2", check=False, env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "gpt3d: error: hellaswag: cannot load Rowan/hellaswag (validation) from the Hugging Face Hub: it is not in the "
        f"local datasets cache and the Hub cannot be reached (127.0.0.1:{port}: [Errno 111] Connection refused). To "
        "score from local files, set evaluate.data_dir=DIR holding DIR/hellaswag/validation.jsonl (and "
        "DIR/hellaswag/train.jsonl for evaluate.num_fewshot > 0), one JSON record per line in the task's published "
        "form (docs/evaluation.md)"]


def test_bench_prints_items_per_second_against_lm_eval_hf(fixture, tmp_path):
    """bench.evaluate on the module's checkpoint, a few short items: three rows, the baseline at 1.0, and
    all three agreeing on the metrics (the bench checks that itself). Figures come from real runs, not here."""
    run_dir, _, _, _ = fixture
    path = tmp_path / "rows.json"
    args = ["--checkpoint", str(run_dir / "checkpoints"), "--items", "6", "--context", "4", "--ending", "2",
            "--threads", "1", "--device", "cpu", "--json", str(path)]
    proc = run_module("bench.evaluate", args, env=clean_env(OFFLINE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(path.read_text())
    assert [r["row"] for r in rows] == ["hf (lm-eval) *", "gpt3d (lm-eval)", "gpt3d scorer"]
    assert rows[0]["ratio"] == 1.0 and all(r["items_per_s"] > 0 for r in rows)
    assert "items/s" in proc.stdout


def test_a_training_run_scores_its_tasks_as_it_goes_and_every_layout_gets_the_same_numbers(tmp_path, corpus, fixture):
    """train.eval_tasks: at every second step (train.eval_tasks_interval) each task's metrics go into
    metrics.jsonl and the offline W&B run, charted against tokens, with their final and best values in the
    summary; the same run at tp=2 on two ranks scores the same accuracies, and perplexities within fp32
    rounding of the one-process run's."""
    import wandb_log
    from cli import metrics

    _, _, data, _ = fixture
    run = ["train.max_steps=4", "train.eval_interval=0", "train.checkpoint_interval=0", "train.eval_tasks=[lambada,piqa]",
           "train.eval_tasks_interval=2", f"evaluate.data_dir={data}"]
    one, tp2 = tmp_path / "one", tmp_path / "tp2"
    train(one, corpus, *run)
    rows = [r for r in metrics(one) if "eval/piqa/acc" in r]
    assert [r["step"] for r in rows] == [2, 4]
    keys = {"eval/lambada/acc", "eval/lambada/ppl", "eval/piqa/acc", "eval/piqa/acc_norm"}
    assert all(keys <= set(r) and 0 <= r["eval/piqa/acc"] <= 1 and r["eval/lambada/ppl"] > 1 for r in rows)
    (run_file,) = one.glob("wandb/offline-run-*/run-*.wandb")
    logged = wandb_log.run_file(run_file)
    assert ("eval/*", "tokens") in logged["metrics"]
    assert [h["eval/piqa/acc"] for h in wandb_log.history(run_file) if "eval/piqa/acc" in h] == [r["eval/piqa/acc"] for r in rows]
    summary = logged["summary"]
    assert summary["eval/piqa/acc_final"] == rows[-1]["eval/piqa/acc"]
    assert summary["eval/piqa/acc_best"] == max(r["eval/piqa/acc"] for r in rows)
    assert summary["eval/lambada/ppl_best"] == min(r["eval/lambada/ppl"] for r in rows)
    train(tp2, corpus, *run, "parallel.tp=2", "logging.wandb.mode=disabled", kind="ranks", nproc=2)
    for got, expected in zip([r for r in metrics(tp2) if "eval/piqa/acc" in r], rows):
        for key in keys:
            assert got[key] == (pytest.approx(expected[key], rel=1e-4) if key.endswith("ppl") else expected[key]), key
