"""Tasks without a model: each published record form → its requests, bad records skipped and counted,
k-shot prompts, the token split lm-eval makes, the settings' checks and the metrics' arithmetic."""

from __future__ import annotations

import json
import math

import pytest

from train.config.sections.evaluate import EvaluateConfig
from train.config.settings import ConfigError
from train.data.tokenizer import EOT, gpt2
from train.evaluation import TaskError, formats, prepare_tasks
from train.evaluation.fewshot import with_examples
from train.evaluation.items import CHOICE, LAST_WORD, PARTIAL, Item
from train.evaluation.requests import encode
from train.evaluation.scorer import Score
from train.evaluation.task_metrics import task_metrics
from train.evaluation.tasks import load_split

FORMS = [
    (formats.lambada, {"text": "He handed her the key"}, (("He handed her the", " key"),), 0),
    (formats.hellaswag, {"activity_label": "Cooking", "ctx_a": "A man cuts onions.", "ctx_b": "he [step] then",
                         "endings": ["fries them.", "sings [title] loudly."], "label": "1"},
     (("Cooking: A man cuts onions. He then", " fries them."), ("Cooking: A man cuts onions. He then", " sings. loudly.")), 1),
    (formats.piqa, {"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Eat the lid.", "label": 0},
     (("Question: Open a jar\nAnswer:", " Twist the lid."), ("Question: Open a jar\nAnswer:", " Eat the lid.")), 0),
    (formats.arc, {"question": {"stem": "What melts ice?", "choices": [{"text": "heat", "label": "A"},
                                                                     {"text": "cold", "label": "B"}]}, "answerKey": "A"},
     (("Question: What melts ice?\nAnswer:", " heat"), ("Question: What melts ice?\nAnswer:", " cold")), 0),
    (formats.arc, {"question": "What melts ice?", "choices": {"text": ["heat", "cold"], "label": ["1", "2"]},
                   "answerKey": "2"},
     (("Question: What melts ice?\nAnswer:", " heat"), ("Question: What melts ice?\nAnswer:", " cold")), 1),
    (formats.storycloze, {"input_sentence_1": "A.", "input_sentence_2": "B.", "input_sentence_3": "C.",
                          "input_sentence_4": "D.", "sentence_quiz1": "E.", "sentence_quiz2": "F.",
                          "answer_right_ending": 2},
     (("A. B. C. D.", " E."), ("A. B. C. D.", " F.")), 1),
    (formats.copa, {"premise": "The man broke his toe.", "choice1": "He dropped a hammer.",
                    "choice2": "He slept.", "question": "cause", "label": 0},
     (("The man broke his toe because", " he dropped a hammer."), ("The man broke his toe because", " he slept.")), 0),
    (formats.winogrande, {"sentence": "The cup fell off the table because _ was tilted.", "option1": "the cup",
                          "option2": "the table", "answer": "2"},
     (("The cup fell off the table because the cup", " was tilted."),
      ("The cup fell off the table because the table", " was tilted.")), 1),
]


@pytest.mark.parametrize("form, record, requests, gold", FORMS, ids=[f[0].__name__ + str(i) for i, f in enumerate(FORMS)])
def test_each_published_form_gives_the_requests_lm_eval_builds(form, record, requests, gold):
    assert form(record) == Item(requests, gold)


def write_jsonl(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def test_malformed_records_are_skipped_and_counted(tmp_path):
    write_jsonl(tmp_path / "piqa" / "validation.jsonl", [
        {"goal": "g", "sol1": "a", "sol2": "b", "label": 1}, "{not json", [1, 2], {"goal": "g", "sol1": "a"},
        {"goal": "g", "sol1": "a", "sol2": "b", "label": 7}, "", {"goal": "h", "sol1": "c", "sol2": "d", "label": "0"},
    ])
    split = load_split("piqa", "validation", tmp_path)
    assert [item.gold for item in split.items] == [1, 0] and split.skipped == 4


def test_unknown_tasks_missing_files_and_empty_tasks_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown task 'hellaswg'; the tasks are \['arc_challenge'"):
        EvaluateConfig(tasks=["hellaswg"], data_dir=str(tmp_path))
    with pytest.raises(TaskError, match=r"piqa: no file .*piqa/validation.jsonl \(the validation split"):
        prepare_tasks(EvaluateConfig(tasks=["piqa"], data_dir=str(tmp_path)), 32)
    write_jsonl(tmp_path / "lambada" / "test.jsonl", ["{}", "oops"])
    with pytest.raises(TaskError, match=r"lambada: .*test.jsonl holds no usable record \(2 malformed\)"):
        prepare_tasks(EvaluateConfig(tasks=["lambada"], data_dir=str(tmp_path)), 32)
    write_jsonl(tmp_path / "piqa" / "validation.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b", "label": 1}])
    with pytest.raises(TaskError, match=r"piqa: no file .*piqa/train.jsonl"):  # the few-shot split
        prepare_tasks(EvaluateConfig(tasks=["piqa"], data_dir=str(tmp_path), num_fewshot=1), 32)


def items(n):
    return tuple(Item(((f"q{i}", f" a{i}"), (f"q{i}", f" b{i}")), i % 2) for i in range(n))


def test_k_shot_prompts_are_seeded_per_item_and_leave_the_item_out_of_its_own_split():
    scored, pool = items(6), items(6)
    once = with_examples(scored, pool, 2, seed=3, same_split=True)
    assert once == with_examples(scored, pool, 2, seed=3, same_split=True)
    assert with_examples(scored[:2], pool, 2, seed=3, same_split=True) == once[:2]  # independent of limit
    assert once != with_examples(scored, pool, 2, seed=4, same_split=True)
    for i, item in enumerate(once):
        prefix = item.requests[0][0].removesuffix(f"q{i}")
        examples = prefix.split("\n\n")[:-1]
        assert len(examples) == 2 and f"q{i}" not in "".join(examples)
        assert all(e in {p.solved for p in pool} for e in examples)
        assert all(context.startswith(prefix) for context, _ in item.requests)
    with pytest.raises(ValueError, match="2-shot prompts need 2 examples, but the few-shot split has only 1"):
        with_examples(items(2), items(2), 2, seed=0, same_split=True)


def test_requests_split_into_tokens_as_lm_eval_splits_them():
    encoder = gpt2()
    context, continuation = encode("Hello big ", "world")  # the trailing space moves to the continuation
    assert encoder.decode(list(context)) == "Hello big" and encoder.decode(list(continuation)) == " world"
    assert encode("", "world") == ((EOT,), tuple(encoder.encode_ordinary("world")))


@pytest.mark.parametrize("section, message", [
    ({"tasks": ["lambada", "piqq"]}, "evaluate.tasks: unknown task 'piqq'"),
    ({"tasks": "lambada"}, "evaluate.tasks='lambada': must be a non-empty list"),
    ({"num_fewshot": -1}, "evaluate.num_fewshot=-1: must be an integer ≥ 0"),
    ({"limit": 0}, "evaluate.limit=0: must be an integer ≥ 1 or null"),
    ({"batch_tokens": 2.5}, "evaluate.batch_tokens=2.5: must be an integer ≥ 1"),
    ({"data_dir": 5}, "evaluate.data_dir=5: must be a path"),
])
def test_settings_refuse_bad_values_in_one_line(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EvaluateConfig(**section)
    assert EvaluateConfig(tasks=["piqa"], limit=None).tasks == ["piqa"]


def test_metrics_arithmetic():
    mc = (Item((("c", " aaaa"), ("c", " b")), 0), Item((("c", " x"), ("c", " yy")), 1))
    scores = [[Score(-4.0, False), Score(-2.0, False)], [Score(-1.0, False), Score(-1.0, False)]]
    # item 0: ll picks b (wrong), per char −1 vs −2 picks aaaa (right); item 1: a tie picks the first (wrong), per char −1 vs −0.5 picks yy
    assert task_metrics(CHOICE, mc, scores) == {"acc": 0.0, "acc_norm": 1.0}
    assert task_metrics(PARTIAL, mc, scores) == {"acc": 0.0}
    words = (Item((("c", " w"),)), Item((("d", " v"),)))
    metrics = task_metrics(LAST_WORD, words, [[Score(-1.0, True)], [Score(-3.0, False)]])
    assert metrics == {"acc": 0.5, "ppl": pytest.approx(math.exp(2.0))}


def test_prepared_tasks_carry_their_examples_limit_and_truncation_counts(tmp_path):
    """prepare_tasks end to end on local files: the first `limit` items, each after one solved example
    of the train split, encoded, with the requests cut to seq_len counted."""
    write_jsonl(tmp_path / "piqa" / "validation.jsonl",
                [{"goal": f"goal {i}", "sol1": "yes", "sol2": "no", "label": i % 2} for i in range(5)])
    write_jsonl(tmp_path / "piqa" / "train.jsonl", [{"goal": "g " * 40, "sol1": "a", "sol2": "b", "label": 0}])
    (task,) = prepare_tasks(EvaluateConfig(tasks=["piqa"], data_dir=str(tmp_path), num_fewshot=1, limit=3), seq_len=32)
    assert len(task.items) == len(task.requests) == 3 and task.skipped == 0
    solved = "Question: " + "g " * 40 + "\nAnswer: a\n\n"
    assert all(context == solved + f"Question: goal {i}\nAnswer:" for i, item in enumerate(task.items)
               for context, _ in item.requests)
    assert task.truncated == 6  # the 40-word example pushes every request past 32 tokens
    assert all(len(r.context) + len(r.continuation) == 33 for requests in task.requests for r in requests)


def test_the_settings_name_exactly_the_tasks_the_table_scores():
    """evaluate.tasks is checked against TASK_NAMES (train/config/sections/evaluate.py, the settings' floor),
    the tasks themselves live in train/evaluation/tasks.py: the two lists must be one."""
    from train.config.sections.evaluate import TASK_NAMES
    from train.evaluation.tasks import TASKS

    assert list(TASKS) == list(TASK_NAMES)
