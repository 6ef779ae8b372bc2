"""Read the history rows of an offline W&B run file (`run-<id>.wandb`), for tests.

The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
records, each with a 7-byte header (crc32c: 4, length: 2 little-endian, type: 1; type 1 = a whole
record, 2/3/4 = first/middle/last piece), whose payloads are protobuf `Record` messages.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # block trailer padding
            pos += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + HEADER])
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending += payload
        if kind in (1, 4):
            out.append(pending)
            pending = b""
    return out


def history(path: Path) -> list[dict]:
    """The logged rows, each {key: value, '_step': step}."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def parsed(path: Path) -> list:
    """Every record of the file as a wandb_internal_pb2.Record (W&B's own message definitions)."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def run_file(path: Path) -> dict:
    """What a run file holds besides the history: the run record (id, name, group, tags, notes, job type,
    resumed), the config and the summary (the last value of each key), the metric definitions and the
    artifacts logged (type, name, aliases sorted (W&B keeps no order), metadata, and each file's path:
    (base64 md5, size))."""
    out = {"run": None, "config": {}, "summary": {}, "metrics": [], "artifacts": []}
    for record in parsed(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out["run"] = {"id": run.run_id, "name": run.display_name, "group": run.run_group, "tags": list(run.tags),
                          "notes": run.notes, "job_type": run.job_type, "resumed": run.resumed}
            out["config"].update(_items(run.config.update))
        elif kind == "config":
            out["config"].update(_items(record.config.update))
        elif kind == "summary":
            out["summary"].update(_items(record.summary.update))
        elif kind == "metric":
            out["metrics"].append((record.metric.name or record.metric.glob_name, record.metric.step_metric))
        elif kind == "artifact":
            artifact = record.artifact
            out["artifacts"].append({
                "type": artifact.type, "name": artifact.name, "aliases": sorted(artifact.aliases),
                "metadata": json.loads(artifact.metadata or "{}"),
                "files": {entry.path: (entry.digest, entry.size) for entry in artifact.manifest.contents},
            })
    return out
