"""Small corpora for the data tests, and the token streams they should give, computed independently of
train.data*: tokenize each document here with tiktoken's GPT-2 encoding, append <|endoftext|>, concatenate.

The documents mix tiny ones (many per window) with huge ones (longer than a whole shuffle chunk), so
windows, chunks and resume points fall both between and inside documents.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from train.data.tokenizer import gpt2

EOT = 50256


def doc(i: int) -> str:
    """Document i: a unique marker, then 0 to ~1200 tokens of varied text."""
    body = ["", "x", "naïve café 🙂\n", "def f(x):\n    return x * 2\n\n", "lorem ipsum dolor sit amet " * 40]
    return f"<<doc{i}>> " + body[i % len(body)] * (1 + i % 3)


def write_texts(root, texts: list[str], prefix: str = "doc") -> None:
    """One .txt file per text, named so that file order is list order."""
    for i, text in enumerate(texts):
        (root / f"{prefix}{i:03d}.txt").write_text(text, encoding="utf-8")


def text_corpus(root, n: int) -> tuple:
    """n .txt files of `doc(i)` in `root`: (root, their texts in file order)."""
    texts = [doc(i) for i in range(n)]
    write_texts(root, texts)
    return root, texts


def files_cfg(root, **keys) -> dict:
    """A data config reading every .txt file of `root` as one stream, documents never cut, plus `keys`."""
    return {"source": "files", "paths": [str(root / "*.txt")], "streams": 1, "piece_chars": 0, **keys}


def in_split(text: str, val_permille: int, validation: bool) -> bool:
    return bool(text) and (zlib.crc32(text.encode()) % 1000 < val_permille) == validation


def token_stream(texts, val_permille: int, validation: bool = False) -> np.ndarray:
    """The token stream of one split of `texts` (empty documents are skipped)."""
    enc, out = gpt2(), []
    for text in texts:
        if in_split(text, val_permille, validation):
            out += enc.encode_ordinary(text) + [EOT]
    return np.array(out, dtype=np.int64)


def take(it, n: int) -> list[torch.Tensor]:
    """The next n batches of a TrainBatches."""
    return [next(it) for _ in range(n)]


def short_doc(i: int) -> str:
    """Document i, a dozen tokens or so: a few of them fill a window of a toy model."""
    return f"<<doc{i}>> short text " + "word " * (i % 4)


def parquet_dataset(root, n_files: int, per_file: int, text=doc) -> list[list[str]]:
    """A local dataset folder as `datasets.load_dataset` reads one: n_files parquet files of `per_file`
    documents (`text(0)`, `text(1)`, ... in file order) and a dataset card naming the features, as Hub
    datasets have (so loading it reads no data file). Returns each file's texts, in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [[text(f * per_file + k) for k in range(per_file)] for f in range(n_files)]
    for f, texts in enumerate(files):
        pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), root / f"train-{f:05d}.parquet",
                       row_group_size=2)
    (root / "README.md").write_text("---\ndataset_info:\n  features:\n  - name: text\n    dtype: string\n"
                                    "  - name: id\n    dtype: int64\n---\n")
    return files


def hub_cfg(root, **keys) -> dict:
    """A data config reading the dataset folder `root` through data.source=hub as one stream, 5 per thousand of
    its records held out, plus `keys`."""
    return {"source": "hub", "name": str(root), "streams": 1, "val_permille": 5, **keys}


def prose(chars: int) -> str:
    """`chars` characters of English prose: the Python documentation's topics (pydoc_data, part of every
    Python), in name order, repeated when more is asked for than they hold."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return (text * (chars // len(text) + 1))[:chars]


def write_small_corpora(root) -> dict:
    """The small corpora a first run tries, by size class: one .txt file of 100 KB, 300 KB and 1 MB of prose,
    and a .jsonl of 14 records of 7,000 characters each (about 100 KB). Returns {class: path}."""
    import json

    paths = {}
    for name, chars in (("100k", 100_000), ("300k", 300_000), ("1m", 1_000_000)):
        paths[name] = root / f"prose_{name}.txt"
        paths[name].write_text(prose(chars), encoding="utf-8")
    text = prose(14 * 7000)
    paths["jsonl14"] = root / "records_14.jsonl"
    paths["jsonl14"].write_text("".join(json.dumps({"text": text[k * 7000 : (k + 1) * 7000]}) + "\n" for k in range(14)))
    return paths
