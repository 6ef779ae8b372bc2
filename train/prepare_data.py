"""`python -m train.prepare_data [data=KIND] [data.KEY=VALUE ...] out=FOLDER [num_proc=N]`.

Tokenizes one source (the same `data` overrides as training) into a folder that ``data=prepared``
trains from; what the folder holds and why it gives the same windows as streaming: train/data/prepare.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from train.config.entry import CONFIG_DIR, EXIT_BAD_INPUT, register_config
from train.config.usage import Help, answer_help

USAGE = "usage: python -m train.prepare_data [data=KIND] [data.KEY=VALUE ...] out=FOLDER [num_proc=N]"


def command_help() -> Help:
    """What `python -m train.prepare_data --help` says."""
    return Help(
        usage=(USAGE.removeprefix("usage: "),),
        purpose="Tokenizes one source of documents once (GPT-2 BPE), with its validation split, into a folder that "
                "data=prepared trains from without tokenizing again; the windows are the same as streaming the "
                "source gives.",
        settings_title="arguments",
        settings=(("data=KIND, data.KEY=VALUE", "the source, as for training: data=stdlib, files or hub, and its "
                                                "keys (docs/configuration.md)"),
                  ("out=FOLDER", "the folder to write (new; required)"),
                  ("num_proc=N", "processes that tokenize (default: this machine's CPUs)")),
        examples=("python -m train.prepare_data data=files 'data.paths=[/data/owt/*.jsonl]' out=data/owt-gpt2",
                  "python -m train.prepare_data data=hub data.name=HuggingFaceFW/fineweb data.config_name=sample-10BT "
                  "out=data/fineweb num_proc=16"),
        more="then: python -m train data=prepared data.path=FOLDER (docs/data.md)",
    )


def main(argv: list[str]) -> int:
    answer_help(argv, command_help)
    from train.data.prepare import bad_summary, prepare
    from train.data.sources import DataError

    try:
        out, num_proc, overrides = _parse(argv)
        src, policy = _source(overrides)
        if out.exists():
            raise DataError(f"out={out} exists; name a new folder (prepare_data never overwrites)")
        info = prepare(src, policy, out, num_proc)
    except DataError as err:
        print(f"gpt3d: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    docs = info["documents"]
    print(f"prepared {out}: {docs['train']} training and {docs['validation']} validation documents, "
          f"{info['tokens']['train']:,} training tokens" + bad_summary(info["bad_records"]))
    return 0


def _parse(argv: list[str]) -> tuple[Path, int, list[str]]:
    from train.data.sources import DataError

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

    from train.config.command_line import check_given
    from train.config.settings import ConfigError
    from train.data.sources import DataError, resolve

    register_config()  # the schema the data groups start from
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise DataError(str(err)) from None
    try:
        check_given(cfg, "python -m train.prepare_data")
    except ConfigError as err:
        raise DataError(str(err)) from None
    if cfg.data.get("source") in ("mixture", "prepared"):
        raise DataError(f"prepare_data prepares one source (stdlib, files or hub), not data.source={cfg.data.source}; "
                        "prepare each source of a mixture separately and list the prepared folders in the mixture")
    spec = resolve(cfg.data)
    return spec.sources[0], spec.on_bad_record


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
