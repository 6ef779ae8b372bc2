"""What every JSON file read back from disk may hold: types, ranges and keys, checked before use.

One checker per file: a checkpoint's state.json, rng.json and manifest.json, the sharding info in
its safetensors headers (train/checkpoint/tensors.py), and a Hugging Face folder's config.json.
Each returns None when the value is valid, else one line naming the file, the field, the value
found and what would be valid. Nothing here changes a value or sets anything by name: a valid
value is used as it is by whoever asked.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import re

from train.checkpoint.parts import CORE_KEYS, ENGINE_COUNTERS

FORMAT, FORMAT_VERSION = "gpt3d-checkpoint", 1
# state.json's keys besides CORE_KEYS: the entries of the parts train/run/loop.py registers
PART_KEYS = frozenset({"step", "tokens", "data", "lr_scheduler", "engine", "extra"})
# what a training run needs to continue, beyond the weights: a checkpoint without them (saved by a tool
# that registers only progress and counters) holds weights to read, not a run to resume
RESUME_KEYS = frozenset({"data", "lr_scheduler", "extra"})
SCHEDULE_CONFIG = {  # the schedule keys a checkpoint records (train/run/schedule.py: SCHEDULE_KEYS) and their values
    "train.max_steps": ("int", 1), "train.global_batch_size": ("int", 1),
    "train.batch_ramp.start": ("int?", 1), "train.batch_ramp.unit": ("str?", None),
    "train.batch_ramp.increment": ("int?", 1), "train.batch_ramp.tokens": ("int?", 0),
    "optim.lr": ("number?", 0), "optim.warmup_tokens": ("int?", 0), "optim.decay_tokens": ("int?", 0),
    "optim.min_lr_ratio": ("number", 0),
}
LAYOUT = {"tp": 1, "pp": 1, "dp": 1}
SHA256 = re.compile(r"[0-9a-f]{64}")
PY_RNG_WORDS = 625  # Mersenne Twister: 624 words and the position


class Invalid(ValueError):
    """One invalid field: the message names the file and the field."""


def state_problem(state, step: int | None) -> str | None:
    """state.json; `step`: what the folder's name says it holds."""
    return _first(lambda: _state(state, step))


def rng_problem(rng, torch_state_bytes: int) -> str | None:
    """rng.json; `torch_state_bytes`: the size of this torch's CPU generator state."""
    return _first(lambda: _rng(rng, torch_state_bytes))


def manifest_problem(manifest, step: int | None) -> str | None:
    return _first(lambda: _manifest(manifest, step))


def sharding_problem(info, names: list[str], file: str) -> str | None:
    """DCP's sharding info of one safetensors file: {tensor: {"saved_offsets": [int, …]}} for
    exactly the tensors `names` the file holds."""
    return _first(lambda: _sharding(info, names, file))


def hf_config_problem(config: dict, file: str) -> str | None:
    """A Hugging Face GPT-2 config.json, as train.init_from reads it."""
    return _first(lambda: _hf_config(config, file))


def _first(check) -> str | None:
    try:
        check()
    except Invalid as err:
        return str(err)
    return None


# ---------------------------------------------------------------------------------------------


def _state(state, step) -> None:
    f = "state.json"
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else state
        raise Invalid(f"state.json is not a {FORMAT} state (format={_show(found)})")
    _keys(state, f, "", required=CORE_KEYS | (PART_KEYS - RESUME_KEYS), optional=RESUME_KEYS)
    if state["format_version"] != FORMAT_VERSION:
        raise Invalid(f"{f}: format_version={_show(state['format_version'])} (written by gpt3d "
                      f"{_show(state['gpt3d'])}); this gpt3d reads version {FORMAT_VERSION}")
    _str(state["gpt3d"], f, "gpt3d")
    _layout(state["layout"], f)
    _model(state["model"], f)
    _keys(state["optimizer"], f, "optimizer", required={"adam_step"})
    _int(state["optimizer"]["adam_step"], f, "optimizer.adam_step", 0)
    _int(state["step"], f, "step", 0)
    if step is not None and state["step"] != step:
        raise Invalid(f"{f}: step={state['step']}, but its folder is named for step {step}: a checkpoint's folder "
                      f"must be step<its step, 8 digits>")
    _int(state["tokens"], f, "tokens", 0)
    if state["tokens"] < state["step"]:
        raise Invalid(f"{f}: tokens={state['tokens']} at step {state['step']}: every step trains on at least one token")
    if "data" in state:
        _data(state["data"], f)
    if "lr_scheduler" in state:
        _keys(state["lr_scheduler"], f, "lr_scheduler", required={"tokens"})
        _int(state["lr_scheduler"]["tokens"], f, "lr_scheduler.tokens", 0)
    _keys(state["engine"], f, "engine", optional=ENGINE_COUNTERS)
    for key, value in state["engine"].items():
        _int(value, f, f"engine.{key}", 0)
    if "extra" in state:
        _keys(state["extra"], f, "extra", required={"schedule"})
        _schedule(state["extra"]["schedule"], f)


def _layout(layout, f: str) -> None:
    _keys(layout, f, "layout", required={*LAYOUT, "zero_stage", "offload_optimizer"})
    for key, low in LAYOUT.items():
        _int(layout[key], f, f"layout.{key}", low)
    _int(layout["zero_stage"], f, "layout.zero_stage", 0, 3)
    _bool(layout["offload_optimizer"], f, "layout.offload_optimizer")


def _model(model, f: str) -> None:
    from model import GPTConfig

    fields = {field.name: field.default for field in dataclasses.fields(GPTConfig)}
    _keys(model, f, "model", optional=fields)
    for key, value in model.items():
        default = fields[key]
        if isinstance(default, bool):  # before int: a bool is an int to isinstance
            _bool(value, f, f"model.{key}")
        elif isinstance(default, str):
            _str(value, f, f"model.{key}")
        elif isinstance(default, float):
            _number(value, f, f"model.{key}", 0)
        elif not (value is None and default is None):  # the ints; d_ff may be None (4·d_model)
            _int(value, f, f"model.{key}", 1)


def _data(data: dict, f: str) -> None:
    _keys(data, f, "data", required={"version", "stream", "windows_served", "source_windows", "lanes"})
    _int(data["version"], f, "data.version", 0)
    _keys(data["stream"], f, "data.stream", optional=data["stream"] if isinstance(data["stream"], dict) else ())
    _int(data["windows_served"], f, "data.windows_served", 0)
    _list(data["source_windows"], f, "data.source_windows")
    for i, n in enumerate(data["source_windows"]):
        _int(n, f, f"data.source_windows[{i}]", 0)
    lanes = data["lanes"]
    _keys(lanes, f, "data.lanes", optional=lanes if isinstance(lanes, dict) else ())
    for name, lane in lanes.items():
        where = f"data.lanes.{name}"
        if re.fullmatch(r"\d+/\d+", name) is None:
            raise Invalid(f"{f}: {where}: a lane is named <source>/<stream> (two integers)")
        _keys(lane, f, where, required={"served", "cursor", "counts"})
        _int(lane["served"], f, f"{where}.served", 0)
        if lane["cursor"] is not None:  # train/data/records.py's: None (the start) or where a stream stands
            _keys(lane["cursor"], f, f"{where}.cursor", required={"epoch", "at", "offset"})
            _int(lane["cursor"]["epoch"], f, f"{where}.cursor.epoch", 0)
            _int(lane["cursor"]["offset"], f, f"{where}.cursor.offset", 0)
        _keys(lane["counts"], f, f"{where}.counts", optional=lane["counts"] if isinstance(lane["counts"], dict) else ())
        for key, value in lane["counts"].items():
            _int(value, f, f"{where}.counts.{key}", 0)


def _schedule(schedule, f: str) -> None:
    _keys(schedule, f, "extra.schedule", required={"config", "resolved"})
    config, resolved = schedule["config"], schedule["resolved"]
    _keys(config, f, "extra.schedule.config", required=SCHEDULE_CONFIG)
    for key, (kind, low) in SCHEDULE_CONFIG.items():
        where, value = f"extra.schedule.config.{key}", config[key]
        if kind.endswith("?") and value is None:
            continue
        if kind.startswith("int"):
            _int(value, f, where, low)
        elif kind.startswith("number"):
            _number(value, f, where, low)
        else:
            _str(value, f, where)
    _keys(resolved, f, "extra.schedule.resolved", required={"peak_lr", "warmup_tokens", "decay_tokens", "min_lr_ratio"})
    _number(resolved["peak_lr"], f, "extra.schedule.resolved.peak_lr", 0, strict=True)
    _int(resolved["warmup_tokens"], f, "extra.schedule.resolved.warmup_tokens", 0)
    _int(resolved["decay_tokens"], f, "extra.schedule.resolved.decay_tokens", 0)
    _number(resolved["min_lr_ratio"], f, "extra.schedule.resolved.min_lr_ratio", 0, 1)
    if resolved["decay_tokens"] < resolved["warmup_tokens"]:
        raise Invalid(f"{f}: extra.schedule.resolved.decay_tokens={resolved['decay_tokens']} is below warmup_tokens="
                      f"{resolved['warmup_tokens']}; it must be at least that")


def _rng(rng, torch_bytes: int) -> None:
    f = "rng.json"
    _keys(rng, f, "", required={"ranks"})
    _list(rng["ranks"], f, "ranks")
    if not rng["ranks"]:
        raise Invalid(f"{f}: ranks is empty; it must hold one entry per rank that saved")
    for i, rank in enumerate(rng["ranks"]):
        where = f"ranks[{i}]"
        _keys(rank, f, where, required={"torch", "python"}, optional={"cuda", "kernels"})
        _b64(rank["torch"], f, f"{where}.torch", torch_bytes)
        if "cuda" in rank:
            _b64(rank["cuda"], f, f"{where}.cuda", None)
        if "kernels" in rank:
            _kernels(rank["kernels"], f, f"{where}.kernels")
        python = rank["python"]
        _list(python, f, f"{where}.python")
        if len(python) != 3:
            raise Invalid(f"{f}: {where}.python has {len(python)} entries; it must be [version, state, gauss]")
        version, internal, gauss = python
        _int(version, f, f"{where}.python[0]", 3, 3)
        _list(internal, f, f"{where}.python[1]")
        if len(internal) != PY_RNG_WORDS:
            raise Invalid(f"{f}: {where}.python[1] holds {len(internal)} numbers; it must hold {PY_RNG_WORDS}")
        for j, word in enumerate(internal[:-1]):
            _int(word, f, f"{where}.python[1][{j}]", 0, 2**32 - 1)
        _int(internal[-1], f, f"{where}.python[1][{PY_RNG_WORDS - 1}]", 0, PY_RNG_WORDS - 1)
        if gauss is not None:
            _number(gauss, f, f"{where}.python[2]", None)


def _manifest(manifest, step) -> None:
    f = "manifest.json"
    _keys(manifest, f, "", required={"format", "format_version", "step", "layout", "files"})
    if manifest["format"] != FORMAT or manifest["format_version"] != FORMAT_VERSION:
        raise Invalid(f"{f}: format={_show(manifest['format'])} version {_show(manifest['format_version'])}; this "
                      f"gpt3d reads {FORMAT} version {FORMAT_VERSION}")
    _int(manifest["step"], f, "step", 0)
    if step is not None and manifest["step"] != step:
        raise Invalid(f"{f}: step={manifest['step']}, but its folder is named for step {step}")
    _layout(manifest["layout"], f)
    files = manifest["files"]
    _keys(files, f, "files", optional=files if isinstance(files, dict) else ())
    for name, entry in files.items():
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            raise Invalid(f"{f}: files names {_show(name)}; only plain file names inside the folder are allowed")
        _keys(entry, f, f"files.{name}", required={"bytes", "sha256"})
        _int(entry["bytes"], f, f"files.{name}.bytes", 0)
        if not isinstance(entry["sha256"], str) or SHA256.fullmatch(entry["sha256"]) is None:
            raise Invalid(f"{f}: files.{name}.sha256={_show(entry['sha256'])}: must be 64 lowercase hex digits")


def _sharding(info, names: list[str], file: str) -> None:
    _keys(info, file, "DCP_SHARDING_INFO", required=names)
    for name in names:
        _keys(info[name], file, f"DCP_SHARDING_INFO.{name}", required={"saved_offsets"})
        offsets = info[name]["saved_offsets"]
        _list(offsets, file, f"DCP_SHARDING_INFO.{name}.saved_offsets")
        for i, o in enumerate(offsets):
            _int(o, file, f"DCP_SHARDING_INFO.{name}.saved_offsets[{i}]", 0)


def _hf_config(config: dict, f: str) -> None:
    if not isinstance(config, dict):
        raise Invalid(f"{f}: holds a {type(config).__name__}; it must be a JSON object (a GPT-2 config)")
    for key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
        _int(config.get(key), f, key, 1)
    if config.get("n_inner") is not None:
        _int(config["n_inner"], f, "n_inner", 1)
    if "layer_norm_epsilon" in config:
        _number(config["layer_norm_epsilon"], f, "layer_norm_epsilon", 0, strict=True)
    for key in ("model_type", "activation_function"):
        if key in config and not isinstance(config[key], str):
            raise Invalid(f"{f}: {key}={_show(config[key])}: must be a string")
    for key in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if key in config and not isinstance(config[key], bool):
            raise Invalid(f"{f}: {key}={_show(config[key])}: must be true or false")


# ---------------------------------------------------------------------------------------------
# the field checks


def _kernels(kernels, f: str, where: str) -> None:
    """model/kernel_choices.py's record: {kernel: [[key, {"kwargs": {name: int}, "num_warps": n, "num_stages": n}], …]}."""
    if not isinstance(kernels, dict):
        raise Invalid(f"{f}: {where} must be a mapping of kernel names, not {_show(kernels)}")
    for name, entries in kernels.items():
        _list(entries, f, f"{where}.{name}")
        for i, entry in enumerate(entries):
            at = f"{where}.{name}[{i}]"
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)):
                raise Invalid(f"{f}: {at} must be [key, config], not {_show(entry)}")
            for j, part in enumerate(entry[0]):
                if not (isinstance(part, str) or (isinstance(part, int) and not isinstance(part, bool))):
                    raise Invalid(f"{f}: {at}[0][{j}] must be an integer or a dtype's name, not {_show(part)}")
            _keys(entry[1], f, f"{at}[1]", required={"kwargs", "num_warps", "num_stages"})
            _int(entry[1]["num_warps"], f, f"{at}[1].num_warps", 1, 64)
            _int(entry[1]["num_stages"], f, f"{at}[1].num_stages", 1, 16)
            if not isinstance(entry[1]["kwargs"], dict):
                raise Invalid(f"{f}: {at}[1].kwargs must be a mapping, not {_show(entry[1]['kwargs'])}")
            for key, value in entry[1]["kwargs"].items():
                _int(value, f, f"{at}[1].kwargs.{key}", 1, 4096)


def _keys(value, f: str, where: str, required=(), optional=()) -> None:
    """`value` is a JSON object holding every `required` key and no key beyond `optional`."""
    label = where or "the file"
    if not isinstance(value, dict):
        raise Invalid(f"{f}: {label} is {_show(value)}; it must be a JSON object")
    missing = sorted(set(required) - set(value))
    extra = sorted(set(value) - set(required) - set(optional))
    if missing:
        raise Invalid(f"{f}: {label} lacks {missing}")
    if extra:
        raise Invalid(f"{f}: {label} holds unknown keys {extra[:5]}; allowed: {sorted({*required, *optional})[:12]}")


def _int(value, f: str, where: str, low: int | None = None, high: int | None = None) -> None:
    if (not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low)
            or (high is not None and value > high)):
        bounds = f" from {low}" if low is not None else ""
        bounds += f" to {high}" if high is not None else ""
        raise Invalid(f"{f}: {where}={_show(value)}: must be an integer{bounds}")


def _number(value, f: str, where: str, low: float | None, high: float | None = None, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or value > low or (value == low and not strict)) and (high is None or value <= high)
    if not ok:
        bounds = f" {'above' if strict else 'at least'} {low}" if low is not None else ""
        bounds += f", at most {high}" if high is not None else ""
        raise Invalid(f"{f}: {where}={_show(value)}: must be a finite number{bounds}")


def _str(value, f: str, where: str) -> None:
    if not isinstance(value, str):
        raise Invalid(f"{f}: {where}={_show(value)}: must be a string")


def _bool(value, f: str, where: str) -> None:
    if not isinstance(value, bool):
        raise Invalid(f"{f}: {where}={_show(value)}: must be true or false")


def _list(value, f: str, where: str) -> None:
    if not isinstance(value, list):
        raise Invalid(f"{f}: {where}={_show(value)}: must be a JSON list")


def _b64(value, f: str, where: str, size: int | None) -> None:
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None or (size is not None and len(raw) != size):
        wanted = f" of {size} bytes" if size is not None else ""
        raise Invalid(f"{f}: {where}={_show(value)}: must be base64 text of a generator state{wanted}")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
