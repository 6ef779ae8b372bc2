"""What fixes the order of the windows a run trains on, and what differs between two such orders, in
the words of the settings that set them.

A checkpoint's data position holds the `stream_id` of the run that wrote it; a resume continues that
position only in the same order. The config checks compare it with the resumed run's before anything
is built (train/run/checks.py: check_resume_data), and loading compares it again
(train/data/batches.py), each naming what changed as `changes` words it.
"""

from __future__ import annotations

from train.data.sources import DataSpec

# the order's own keys, by the setting that sets them
TOP_KEYS = {"seq_len": "model.seq_len", "seed": "train.seed", "streams": "data.streams",
            "shuffle_buffer": "data.shuffle_buffer", "weights": "the mixture's weights"}
# what a source reads (SourceSpec.fingerprint): when these change, what follows from them (how a text file is
# cut, its validation tail) changes with them and is not named
IDENTITY = ("reader", "files", "files_crc32", "name", "config_name", "split", "path")


def stream_id(spec: DataSpec, seq_len: int, seed: int) -> dict:
    """What fixes the global order of windows: the sources, streams, shuffle buffer, window and seed."""
    return {**spec.fingerprint(), "seq_len": seq_len, "seed": seed}


def changes(then: dict, now: dict) -> list[str]:
    """What differs from stream id `then` to `now`, each as "<setting> <then> → <now>". Of a source that
    reads something else (another kind of source, other files or dataset), only that is named."""
    said = [f"{name} {_shown(then.get(key))} → {_shown(now.get(key))}"
            for key, name in TOP_KEYS.items() if then.get(key) != now.get(key)]
    before, after = then.get("sources") or [], now.get("sources") or []
    if len(before) != len(after):
        return [f"data.sources: {len(before)} → {len(after)} source(s)", *said]
    for j, (a, b) in enumerate(zip(before, after)):
        where = "data." if len(after) == 1 else f"data.sources[{j}]."
        changed = [key for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
        if "kind" in changed:
            changed = ["kind"]
        elif "reader" in changed:
            changed = ["reader"]
        elif any(key in changed for key in IDENTITY):
            changed = [key for key in IDENTITY if key in changed and not (key == "files_crc32" and "files" in changed)]
        said += [_source_change(where, key, a.get(key), b.get(key)) for key in changed]
    return said


def _source_change(where: str, key: str, then, now) -> str:
    if key == "kind":
        return f"{where}source {then} → {now}"
    if key == "reader":
        return f"{where}paths: {then} → {now} files"
    if key == "files":
        return f"{where}paths: {then} → {now} file(s)"
    if key == "files_crc32":
        return f"{where}paths: other file names"
    if key == "val_tail":
        return (f"the validation tail {_shown(then)} → {_shown(now)} (for a small corpus: sized by train.eval_batches, "
                "train.global_batch_size and model.seq_len)")
    return f"{where}{key} {_shown(then)} → {_shown(now)}"


def _shown(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return "(" + ", ".join(str(v) for v in value) + ")"
    return str(value)
