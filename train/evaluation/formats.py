"""Records in each task's published form → Items (train/evaluation/items.py).

Each function takes one decoded JSON record and returns its Item, or raises KeyError, TypeError,
IndexError or ValueError for a record that lacks what the form needs (the loader skips and counts
it). The prompts are those lm-eval's own task definitions build, so results compare with its:

  lambada     {"text"}: context = all but the last word, continuation = " " + last word
  hellaswag   {"activity_label", "ctx_a", "ctx_b", "endings", "label"}: "<activity>: <ctx_a> <Ctx_b>",
              WikiHow's bracket artefacts removed; each ending after " "
  piqa        {"goal", "sol1", "sol2", "label"}: "Question: <goal>\\nAnswer:" then " " + sol_i
  arc         AI2's {"question": {"stem", "choices": [{"text", "label"}]}, "answerKey"} or the Hub's
              flat {"question", "choices": {"text", "label"}, "answerKey"}: "Question: <stem>\\nAnswer:"
  storycloze  {"input_sentence_1" … "_4", "sentence_quiz1", "sentence_quiz2", "answer_right_ending"}:
              the four sentences, then " " + each fifth sentence
  copa        SuperGLUE's {"premise", "choice1", "choice2", "question", "label"}: the premise without
              its full stop + " because" (cause) or " therefore" (effect), then " " + each choice,
              first letter lower-cased
  winogrande  {"sentence", "option1", "option2", "answer"}: partial scoring, the sentence up to "_"
              with each option, then " " + the rest of the sentence
"""

from __future__ import annotations

import re

from train.evaluation.items import TARGET_DELIMITER, Item


def _text(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key!r} must be a non-empty string")
    return value


def _choice(record: dict, key: str, count: int) -> int:
    """A gold index given as an int or a digit string, checked to name one of `count` choices."""
    value = record[key]
    index = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    if index is None or not 0 <= index < count:
        raise ValueError(f"{key!r}={value!r} names none of the {count} choices")
    return index


def _choices(context: str, endings: list[str], gold: int) -> Item:
    return Item(tuple((context, TARGET_DELIMITER + ending) for ending in endings), gold)


def lambada(record: dict) -> Item:
    context, _, word = _text(record, "text").rpartition(" ")
    if not context or not word:
        raise ValueError("'text' has no last word after a space")
    return Item(((context, TARGET_DELIMITER + word),))


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag(record: dict) -> Item:
    context = f"{_text(record, 'activity_label')}: {record['ctx_a']} {str(record['ctx_b']).capitalize()}"
    endings = [_hellaswag_clean(ending) for ending in record["endings"]]
    if len(endings) < 2 or not all(endings):
        raise ValueError("'endings' must hold at least two non-empty endings")
    return _choices(_hellaswag_clean(context), endings, _choice(record, "label", len(endings)))


def piqa(record: dict) -> Item:
    endings = [_text(record, "sol1"), _text(record, "sol2")]
    return _choices(f"Question: {_text(record, 'goal')}\nAnswer:", endings, _choice(record, "label", 2))


def arc(record: dict) -> Item:
    question = record["question"]
    if isinstance(question, dict):  # AI2's own form
        stem, options = question["stem"], question["choices"]
        texts, labels = [o["text"] for o in options], [o["label"] for o in options]
    else:  # the Hub's flat form
        stem, texts, labels = question, record["choices"]["text"], record["choices"]["label"]
    if len(texts) < 2 or len(texts) != len(labels) or not all(isinstance(t, str) and t for t in texts):
        raise ValueError("'choices' must hold at least two labelled, non-empty texts")
    return _choices(f"Question: {stem}\nAnswer:", texts, labels.index(record["answerKey"]))


def storycloze(record: dict) -> Item:
    story = " ".join(_text(record, f"input_sentence_{i}") for i in range(1, 5))
    endings = [_text(record, "sentence_quiz1"), _text(record, "sentence_quiz2")]
    return _choices(story, endings, {"1": 0, "2": 1}[str(record["answer_right_ending"])])


def copa(record: dict) -> Item:
    connector = {"cause": "because", "effect": "therefore"}[record["question"]]
    context = f"{_text(record, 'premise').strip()[:-1]} {connector}"
    endings = [(c := _text(record, key))[0].lower() + c[1:] for key in ("choice1", "choice2")]
    return _choices(context, endings, _choice(record, "label", 2))


def winogrande(record: dict) -> Item:
    sentence = _text(record, "sentence")
    blank = sentence.index("_")
    rest = TARGET_DELIMITER + sentence[blank + 1 :].strip()
    options = [_text(record, "option1"), _text(record, "option2")]
    gold = {"1": 0, "2": 1}[str(record["answer"])]
    return Item(tuple((sentence[:blank] + option, rest) for option in options), gold)
