"""Tokenize a corpus once, in parallel, into a `datasets` folder that ``data=prepared`` trains from
(the command is train/prepare_data.py).

    python -m train.prepare_data data=files 'data.paths=[/data/owt/*.jsonl]' out=/data/owt-gpt2 [num_proc=16]
    python -m train data=prepared data.path=/data/owt-gpt2

Takes the same `data` overrides as training (any single source: stdlib, files, hub). Records are read
in the source's order with the same decoding and bad-record policy as streaming; `datasets` does the
rest: `Dataset.from_generator` collects the documents, `map(num_proc=...)` tokenizes them in parallel,
and `DatasetDict.save_to_disk` writes a ``train`` and a ``validation`` split, each row a document's
record index (``doc``) and its GPT-2 tokens ending in ``<|endoftext|>`` (``tokens``). The folder is
written under a temporary name and renamed into place when complete. Training from it gives the same
windows in the same order as streaming the source with the same seed and streams.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from train.data.records import Bad, BadRecords, in_validation, records
from train.data.sources import PREPARED_MARK, DataError
from train.data.tokenizer import EOT, gpt2


def _documents(src, policy: str):
    """Every record of `src` in order: its index, text (empty for a skipped one), split and skip reason."""
    bad = BadRecords(policy)
    for record in records(src, 0, 1):
        text = record.text
        if isinstance(text, Bad):
            bad.skip(record)
            yield {"doc": record.index, "text": "", "validation": False, "bad": f"{record.file}\t{text.reason}"}
        else:
            yield {"doc": record.index, "text": text, "validation": bool(text) and in_validation(record, src.val_permille),
                   "bad": ""}


def _tokenize(batch: dict) -> dict:
    """GPT-2 tokens of each text, then <|endoftext|>."""
    return {"tokens": [ids + [EOT] for ids in gpt2().encode_ordinary_batch(batch["text"], num_threads=1)]}


def prepare(src, policy: str, out: Path, num_proc: int) -> dict:
    """Write the prepared folder for `src` at `out` (via a temporary sibling); returns its metadata."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        features = datasets.Features({"doc": datasets.Value("int64"), "text": datasets.Value("string"),
                                      "validation": datasets.Value("bool"), "bad": datasets.Value("string")})
        try:
            rows = datasets.Dataset.from_generator(
                _documents, features=features, gen_kwargs={"src": src, "policy": policy}, cache_dir=str(tmp / "cache")
            )
        except datasets.exceptions.DatasetGenerationError as err:
            cause = err.__cause__
            raise (cause if isinstance(cause, DataError) else err) from None
        bad = {}
        for tag in rows.filter(lambda b: [x != "" for x in b], input_columns="bad", batched=True)["bad"]:
            file, reason = tag.split("\t")
            bad.setdefault(file, {})[reason] = bad.get(file, {}).get(reason, 0) + 1
        kept = rows.filter(lambda t: [x != "" for x in t], input_columns="text", batched=True)
        tokens = kept.map(_tokenize, batched=True, num_proc=num_proc, remove_columns=["text", "bad"],
                          features=datasets.Features({"doc": datasets.Value("int64"), "validation": datasets.Value("bool"),
                                                      "tokens": datasets.List(datasets.Value("int32"))}))
        splits = {}
        for name, flag in (("train", False), ("validation", True)):
            part = tokens.filter(lambda v, flag=flag: [x == flag for x in v], input_columns="validation", batched=True)
            splits[name] = part.remove_columns("validation")
        if len(splits["train"]) == 0:
            raise DataError(f"data: {src.label}: no training documents to prepare ({len(rows)} records read, "
                            f"{len(splits['validation'])} held out for validation)" + bad_summary(bad))
        info = {
            "format": PREPARED_MARK,
            "tokenizer": "gpt2",
            "source": src.fingerprint(),
            "val_permille": src.val_permille,
            "encoding": src.encoding,
            "records": len(rows),
            "documents": {name: len(split) for name, split in splits.items()},
            "tokens": _count_tokens(tokens),
            "bad_records": bad,
        }
        for split in splits.values():
            split.info.description = json.dumps(info)
        datasets.DatasetDict(splits).save_to_disk(str(tmp / "data"))
        os.rename(tmp / "data", out)
        return info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _count_tokens(tokens) -> dict:
    """Tokens per split, from the tokenized table (the splits are filtered views of it)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(tokens.data.column("tokens"))
    held_out = tokens.data.column("validation")
    count = lambda mask: int(pc.sum(pc.filter(lengths, mask)).as_py() or 0)
    return {"train": count(pc.invert(held_out)), "validation": count(held_out)}


def bad_summary(bad: dict) -> str:
    if not bad:
        return ""
    parts = [f"{file}: " + ", ".join(f"{reason} ×{n}" for reason, n in reasons.items()) for file, reasons in bad.items()]
    return "; skipped bad records: " + "; ".join(parts)
