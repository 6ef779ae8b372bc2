"""`python -m train.prepare_data [data=KIND] [data.KEY=VALUE ...] out=FOLDER [num_proc=N]`.

Tokenizes one source (the same `data` overrides as training) into a folder that ``data=prepared``
trains from; what the folder holds and why it gives the same windows as streaming: train/data/prepare.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from train.config.entry import CONFIG_DIR, EXIT_BAD_INPUT, register_config
from train.data.prepare import bad_summary, prepare
from train.data.sources import DataError, resolve

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
        return EXIT_BAD_INPUT
    docs = info["documents"]
    print(f"prepared {out}: {docs['train']} training and {docs['validation']} validation documents, "
          f"{info['tokens']['train']:,} training tokens" + bad_summary(info["bad_records"]))
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

    register_config()  # the schema the data groups start from
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


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
