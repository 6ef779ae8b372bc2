"""Tokenize a corpus once, in parallel, into a `datasets` folder that ``data=prepared`` trains from.

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
import sys
from pathlib import Path

from train.data_records import Bad, BadRecords, is_validation, records
from train.data_sources import PREPARED_MARK, DataError, resolve
from train.tokenizer import EOT, gpt2

USAGE = "usage: python -m train.prepare_data [data=KIND] [data.KEY=VALUE ...] out=FOLDER [num_proc=N]"


def main(argv: list[str]) -> int:
    try:
        out, num_proc, overrides = _parse(argv)
        src, policy = _source(overrides)
        if out.exists():
            raise DataError(f"out={out} exists; name a new folder (prepare_data never overwrites)")
        info = prepare(src, policy, out, num_proc)
    except DataError as err:
        print(f"gpt3d: error: {err}", file=sys.stderr)
        return 2
    docs = info["documents"]
    print(f"prepared {out}: {docs['train']} training and {docs['validation']} validation documents, "
          f"{info['tokens']['train']:,} training tokens" + _bad_summary(info["bad_records"]))
    return 0


def _parse(argv: list[str]) -> tuple[Path, int, list[str]]:
    out, num_proc, overrides = None, os.cpu_count() or 1, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "out" and value:
            out = Path(value).expanduser().resolve()
        elif key == "num_proc":
            if not value.isdigit() or int(value) < 1:
                raise DataError(f"num_proc={value!r} must be a whole number >= 1")
            num_proc = int(value)
        elif key.lstrip("+").split(".")[0] == "data" and value:
            overrides.append(arg)
        else:
            raise DataError(f"{arg!r}: prepare_data takes data overrides (data=KIND, data.KEY=VALUE), out= and num_proc=\n{USAGE}")
    if out is None:
        raise DataError(f"out=FOLDER is required\n{USAGE}")
    return out, num_proc, overrides


def _source(overrides: list[str]):
    """The one source the overrides describe (composed with the run configs' data defaults)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from train.config_keys import CONFIG_DIR

    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise DataError(str(err)) from None
    if cfg.data.get("source") in ("mixture", "prepared"):
        raise DataError(f"prepare_data prepares one source (stdlib, files or hub), not data.source={cfg.data.source}; "
                        "prepare each source of a mixture separately and list the prepared folders in the mixture")
    spec = resolve(cfg.data)
    return spec.sources[0], spec.on_bad_record


def _documents(src, policy: str):
    """Every record of `src` in order: its index, text (empty for a skipped one), split and skip reason."""
    bad = BadRecords(policy)
    for record in records(src, 0, 1):
        text = record.text
        if isinstance(text, Bad):
            bad.skip(record)
            yield {"doc": record.index, "text": "", "validation": False, "bad": f"{record.file}\t{text.reason}"}
        else:
            yield {"doc": record.index, "text": text, "validation": bool(text) and is_validation(text, src.val_permille),
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
                            f"{len(splits['validation'])} held out for validation)" + _bad_summary(bad))
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


def _bad_summary(bad: dict) -> str:
    if not bad:
        return ""
    parts = [f"{file}: " + ", ".join(f"{reason} ×{n}" for reason, n in reasons.items()) for file, reasons in bad.items()]
    return "; skipped bad records: " + "; ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
