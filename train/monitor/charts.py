"""A run's curves without a dashboard: from each run folder's metrics.jsonl, the training and validation
loss, the learning rate, tokens/s and the gradient norm against tokens seen, one panel each (the two
losses share one), one colour per run, drawn into a PNG with matplotlib (the `curves` extra).

Several runs are told apart by their folders' names and the settings in which they differ: each run's
composed config (<run dir>/.hydra/config.yaml) is compared with the others', and its label names up to
LABEL_SETTINGS of the keys whose values are not the same in every run.

The PNG also carries the numbers it shows, as JSON in a text chunk (`DATA_KEY`: {"runs": [{"run": folder,
"label": its label, "series": {metric: [tokens, values]}}]}), so what a picture shows can be read back
exactly (`read_back`). `python -m train.curves` draws any runs; a run draws its own at its end
(logging.curves, `after_run`).
"""

from __future__ import annotations

import json
from pathlib import Path

METRICS = ("train/loss", "val/loss", "train/lr", "perf/tokens_per_s", "train/grad_norm")
PANELS = ((("train/loss", "val/loss"), "loss"), (("train/lr",), "learning rate"),
          (("perf/tokens_per_s",), "tokens/s"), (("train/grad_norm",), "gradient norm"))
DATA_KEY = "gpt3d curves"  # the PNG text chunk holding the series drawn
FILE_NAME = "curves.png"
MISSING = "needs matplotlib: pip install -e '.[curves]'"
LABEL_SETTINGS = 3  # the differing settings a run's label names (then "…")


class CurvesError(ValueError):
    """Curves that cannot be drawn: a folder without metrics, or no matplotlib; the message says which."""


def series(run_dir: Path) -> dict[str, list[list]]:
    """{metric: [tokens, values]} of a run folder's metrics.jsonl, each metric over the records that hold it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise CurvesError(f"{run_dir} holds no metrics.jsonl (is it a run folder?)")
    out = {key: [[], []] for key in METRICS}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for key in METRICS:
            if record.get(key) is not None:
                out[key][0].append(record["tokens"])
                out[key][1].append(record[key])
    return out


def labels(run_dirs: list[Path]) -> list[str]:
    """Each run's label: its folder's name, then, with several runs, `key=value` for each setting (up to
    LABEL_SETTINGS) whose value is not the same in every run's .hydra/config.yaml (a run without one: its name)."""
    names = [Path(run_dir).name for run_dir in run_dirs]
    if len(run_dirs) < 2:
        return names
    settings = [_settings(Path(run_dir)) for run_dir in run_dirs]
    keys = sorted({key for values in settings for key in values})
    differing = [key for key in keys if len({repr(values.get(key)) for values in settings}) > 1]
    out = []
    for name, values in zip(names, settings):
        shown = [f"{key}={values[key]}" for key in differing if key in values]
        more = " …" if len(shown) > LABEL_SETTINGS else ""
        out.append(" ".join([name, *shown[:LABEL_SETTINGS]]) + more)
    return out


def _settings(run_dir: Path) -> dict:
    """{dotted key: value} of a run's composed config ({} without one)."""
    from omegaconf import OmegaConf

    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return {}
    flat = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(OmegaConf.to_container(OmegaConf.load(path)), "")
    return flat


def draw(run_dirs: list[Path], out: Path) -> Path:
    """The curves of `run_dirs` into the PNG `out`; returns it. CurvesError without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise CurvesError(f"drawing curves {MISSING}") from None
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    runs = [{"run": str(run_dir), "label": label, "series": series(run_dir)}
            for run_dir, label in zip(run_dirs, labels(run_dirs))]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for colour, run in enumerate(runs):
        name = run["label"] if len(runs) > 1 else ""
        for ax, (keys, title) in zip(axes.flat, PANELS):
            for key in keys:
                tokens, values = run["series"][key]
                kind = {"train/loss": "training", "val/loss": "validation"}.get(key, "")
                validation = key == "val/loss"
                ax.plot(tokens, values, color=f"C{colour}", linestyle="--" if validation else "-",
                        marker="o" if validation else None, markersize=3,
                        label=": ".join(part for part in (name, kind) if part) or None)
            ax.set_title(title)
    for ax, (keys, _) in zip(axes.flat, PANELS):
        ax.set_xlabel("tokens")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k, 1.5M, 300G: tick labels that fit
        ax.grid(alpha=0.3)
        if len(keys) > 1 or len(runs) > 1:
            ax.legend(fontsize="small")
    axes[0][0].set_yscale("log")
    axes[1][0].ticklabel_format(axis="y", style="plain")
    fig.suptitle(runs[0]["run"] if len(runs) == 1 else f"{len(runs)} runs")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100, metadata={DATA_KEY: json.dumps({"runs": runs})})
    plt.close(fig)
    return out


def read_back(png: Path) -> dict:
    """The series a PNG of `draw` shows: {"runs": [{"run": folder, "label": its label, "series": {metric: [tokens,
    values]}}]}."""
    from PIL import Image

    with Image.open(png) as image:
        return json.loads(image.text[DATA_KEY])


def after_run(run_dir: Path) -> str:
    """The line a run ends with: where its curves are, drawn now, or how to draw them without matplotlib."""
    try:
        return f"curves: {draw([run_dir], Path(run_dir) / FILE_NAME)}"
    except CurvesError:
        return f"curves: python -m train.curves {run_dir} draws them ({MISSING})"
