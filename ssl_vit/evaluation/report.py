"""`ssl-vit compare`: one suite on many checkpoints, one table and a few pictures.

Writes results.csv and results.md (one row per checkpoint, one column per protocol result, the best
per column marked), fewshot.png (accuracy against labelled examples per class, one line per
checkpoint), bars.png (a bar chart per protocol), attention_distance.png and .json (the ViT paper's
mean attention distance against depth, sec 4.5, one curve per checkpoint, on `ATTENTION_IMAGES`
images of the first dataset's test split), each checkpoint's own results.json, and an offline W&B
run with the table and the pictures. A checkpoint that fails gets its error in its row; the others'
results are never lost.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from ssl_vit.analysis.attention import attention_distance
from ssl_vit.analysis.images import read_images
from ssl_vit.analysis.pictures import attention_distance_curves
from ssl_vit.checkpoints import load_backbone
from ssl_vit.data import ShardDataModule
from ssl_vit.evaluation.protocols import DATA_KEYS
from ssl_vit.evaluation.ranks import Failed, evaluate_checkpoints, failure
from ssl_vit.evaluation.suite import Suite, write_record

# A few images suffice: a head's mean attention distance varies little from image to image.
ATTENTION_IMAGES = 64


def compare(checkpoints: dict[str, str], suite: Suite, out_dir: str | Path) -> list[dict] | None:
    """checkpoints: name -> source (path, timm:NAME or scratch). Returns the rows written; under
    torchrun the checkpoints are spread over the ranks (`ranks.py`) and only rank 0 writes and returns
    them (None on the others)."""
    outcomes = evaluate_checkpoints(checkpoints, suite)
    if outcomes is None:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    curves: dict[str, torch.Tensor] = {}  # name -> (L, H) mean attention distance in pixels
    images = None
    for name, source in checkpoints.items():
        row = {"name": name, "checkpoint": source, "error": ""}
        outcome = outcomes[name]
        if not isinstance(outcome, Failed):
            write_record(outcome, out / name)
            row.update(outcome["results"])
            row["details"] = outcome["details"]
            try:
                if images is None:
                    images = attention_images(suite)
                curves[name] = attention_curve(source, suite, images)
            except Exception as err:
                outcome = failure(err)
        if isinstance(outcome, Failed):  # one broken checkpoint must not lose the others' results
            row["error"] = outcome.error
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "error.txt").write_text(outcome.traceback)
        rows.append(row)
    columns = suite.columns()
    write_csv(rows, columns, out / "results.csv")
    (out / "results.md").write_text(markdown_table(rows, columns))
    pictures = [plot_fewshot(rows, suite, out / "fewshot.png"), plot_bars(rows, columns, out / "bars.png")]
    if curves:
        write_attention_distance(curves, len(images), out / "attention_distance.json")
        attention_distance_curves(curves, out / "attention_distance.png")
        pictures.append(out / "attention_distance.png")
    log_to_wandb(rows, columns, [p for p in pictures if p is not None], out)
    return rows


def attention_images(suite: Suite) -> torch.Tensor:
    """(n, 3, H, W): the first `ATTENTION_IMAGES` images of the first dataset's test split, normalised."""
    data = next(iter(suite.datasets.values()))
    datamodule = ShardDataModule(
        test_urls=data["test_urls"], **{k: v for k, v in data.items() if k in DATA_KEYS}
    )
    return read_images(datamodule, "test", ATTENTION_IMAGES)[0]


def attention_curve(source: str, suite: Suite, images: torch.Tensor) -> torch.Tensor:
    """(L, H) mean attention distance (pixels) of every head of the checkpoint's backbone on `images`."""
    torch.manual_seed(suite.seed)  # `scratch` is the same random backbone `evaluate` drew
    backbone, _ = load_backbone(source, suite.backbone)
    backbone.eval()
    return attention_distance(backbone, images, batch_size=ATTENTION_IMAGES)


def write_attention_distance(curves: dict[str, torch.Tensor], images: int, path: Path) -> None:
    """The numbers of attention_distance.png: per checkpoint, per block, mean over heads and per head."""
    record = {
        "images": images,
        "unit": "pixels",
        "checkpoints": {
            name: {
                "mean_per_layer": [round(v, 4) for v in per_head.mean(1).tolist()],
                "per_head": [[round(v, 4) for v in heads] for heads in per_head.tolist()],
            }
            for name, per_head in curves.items()
        },
    }
    path.write_text(json.dumps(record, indent=1) + "\n")


def write_csv(rows: list[dict], columns: list[str], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["name", "checkpoint", *columns, "error"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _best(rows: list[dict], column: str) -> float | None:
    values = [row[column] for row in rows if isinstance(row.get(column), float)]
    return max(values) if values else None


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """One row per checkpoint, one column per result; the best of each column in bold."""
    lines = ["| checkpoint | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for row in rows:
        if row["error"]:
            cells = [f"failed: {row['error']}"] + [""] * (len(columns) - 1)
        else:
            cells = []
            for column in columns:
                value = row.get(column)
                text = f"{100 * value:.1f}" if isinstance(value, float) else "-"
                cells.append(f"**{text}**" if value is not None and value == _best(rows, column) else text)
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nAccuracy in %; best per column in bold.\n"


def plot_fewshot(rows: list[dict], suite: Suite, path: Path) -> Path | None:
    """Accuracy against labelled examples per class, one line per checkpoint, one panel per few-shot
    protocol; trained protocols (linear probe, fine-tune) as points at the full training set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fewshots = [p for p in suite.protocols if p.kind == "fewshot"]
    trained = [p for p in suite.protocols if p.kind in ("linear_probe", "finetune")]
    if not fewshots:
        return None
    fig, axes = plt.subplots(1, len(fewshots), figsize=(5 * len(fewshots), 4), squeeze=False)
    for ax, protocol in zip(axes[0], fewshots):
        for row in rows:
            if row["error"]:
                continue
            shots = [s for s in protocol.shots if isinstance(row.get(f"{protocol.name}_{s}shot"), float)]
            (line,) = ax.plot(
                shots, [100 * row[f"{protocol.name}_{s}shot"] for s in shots], marker="o", label=row["name"]
            )
            for marker, p in zip("s^", trained):
                if protocol.classes is None and isinstance(row.get(p.name), float):
                    ax.scatter(
                        [row["details"][p.name]["labels_per_class"]],
                        [100 * row[p.name]],
                        marker=marker,
                        color=line.get_color(),
                        label=f"{row['name']} {p.name} (all labels)",
                    )
        ax.set_xscale("log")
        ax.set_xlabel("labelled examples per class")
        ax.set_ylabel("accuracy (%)")
        classes = "all classes" if protocol.classes is None else f"classes {protocol.classes}"
        ax.set_title(f"{protocol.name} ({classes})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(rows: list[dict], columns: list[str], path: Path) -> Path | None:
    """A bar chart per result column, one bar per checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [row for row in rows if not row["error"]]
    if not good or not columns:
        return None
    fig, axes = plt.subplots(1, len(columns), figsize=(2.2 * len(columns) + 1, 3.2), squeeze=False)
    for ax, column in zip(axes[0], columns):
        values = [100 * row[column] if isinstance(row.get(column), float) else 0.0 for row in good]
        ax.bar(range(len(good)), values, color=[f"C{i}" for i in range(len(good))])
        ax.set_xticks(range(len(good)), [row["name"] for row in good], rotation=45, ha="right", fontsize=8)
        ax.set_title(column, fontsize=9)
        ax.set_ylim(0, 100)
    axes[0][0].set_ylabel("accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_to_wandb(rows: list[dict], columns: list[str], pictures: list[Path], out: Path) -> None:
    """The table and pictures as one W&B run (offline unless the user opted in)."""
    import wandb

    from ssl_vit.tracking import wandb_opted_in

    run = wandb.init(
        project="ssl-vit-compare",
        dir=str(out),
        mode=None if wandb_opted_in() else "offline",
        job_type="compare",
        config={"columns": columns},
    )
    table = wandb.Table(columns=["name", "checkpoint", *columns, "error"])
    for row in rows:
        table.add_data(row["name"], row["checkpoint"], *[row.get(c) for c in columns], row["error"])
    run.log({"results": table, **{p.stem: wandb.Image(str(p)) for p in pictures}})
    run.finish()
    (out / "wandb-run.json").write_text(json.dumps({"id": run.id, "dir": str(run.dir)}) + "\n")
