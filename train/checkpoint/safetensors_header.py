"""A safetensors file's header, read and checked without the safetensors library or any tensor data.

The header is an 8-byte little-endian length and that many bytes of JSON: {tensor name: {"dtype",
"shape", "data_offsets"}, "__metadata__": {str: str}}. `read_header` bounds the length (by the file
and by MAX_HEADER_BYTES) before reading it, and checks that every entry is well-formed and that the
tensors' byte ranges fit the file, so a crafted header can neither exhaust memory nor point outside
the data.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]


def read_header(file: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """({tensor name: its dtype and shape}, the string metadata) of a safetensors file; ValueError
    naming the file and what is wrong."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file.name}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{file.name}: its header claims {length} bytes, more than the file's {size - 8} "
                             f"(or the limit of {MAX_HEADER_BYTES})")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"{file.name}: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file.name}: its header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{file.name}: its header's __metadata__ is not an object of strings")
    entries, data_bytes = {}, size - 8 - length
    for name, entry in header.items():
        entries[name] = _entry(file.name, name, entry, data_bytes)
    return entries, metadata


def _entry(file: str, name: str, entry, data_bytes: int) -> TensorEntry:
    valid = (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}
             and entry["dtype"] in DTYPE_BYTES and isinstance(entry["shape"], list)
             and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry["shape"])
             and isinstance(entry["data_offsets"], list) and len(entry["data_offsets"]) == 2
             and all(isinstance(n, int) and not isinstance(n, bool) for n in entry["data_offsets"]))
    if not valid:
        raise ValueError(f"{file}: the header entry of {name!r} is not {{dtype, shape, data_offsets}}")
    begin, end = entry["data_offsets"]
    if not 0 <= begin <= end <= data_bytes or end - begin != DTYPE_BYTES[entry["dtype"]] * math.prod(entry["shape"]):
        raise ValueError(f"{file}: {name!r} claims bytes {begin}..{end}, which do not hold a {entry['dtype']} "
                         f"tensor of shape {entry['shape']} inside the file")
    return TensorEntry(entry["dtype"], tuple(entry["shape"]))
