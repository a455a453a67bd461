"""What the order shards were written in does to a supervised fit: the quickstart's digits, the same
training images in three layouts, the quickstart's supervised recipe (labels of digits 0-4) from two
seeds on each, then `ssl-vit compare` with the quickstart's suite (few-shot, k-NN, linear probe, 95%
intervals, paired against the shuffled layout):

- `shuffled`: converted in a seeded random order (`data convert`'s default);
- `sorted`: converted in label order (`--order source` of an `npz:` sorted by label), read through the
  epoch's global order (local .tar shards);
- `sorted_gz`: the same sorted shards gzipped, which the stream reads as segments of shards through a
  shuffle buffer (as it reads remote shards): what every layout got before the global order.

    .venv/bin/python benchmarks/sorted_shards_fit.py [--epochs 15] [--out runs/sorted_shards]

Needs the quickstart's shards (`make quickstart` writes data/shards/digits; converted here if missing).
The results go to OUT/compare/results.md; benchmarks/RESULTS.md records a run.
"""

import argparse
import gzip
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SSLVIT = str(Path(sys.executable).parent / "ssl-vit")
DIGITS = ROOT / "data/shards/digits"


def run(*args: str) -> None:
    print("$ ssl-vit " + " ".join(args), flush=True)
    subprocess.run([SSLVIT, *args], cwd=ROOT, check=True)


def layouts(out: Path) -> dict[str, str]:
    """The three training layouts of the digits' training images; their URLs."""
    for split, size in (("train", "300"), ("val", "100")):  # as `make quickstart` converts them
        if not (DIGITS / f"{split}.json").exists():
            run("data", "convert", "digits", str(DIGITS), "--split", split, "--shard-size", size)
    manifest = json.loads((DIGITS / "train.json").read_text())
    urls = [str(DIGITS / s["url"]) for s in manifest["shards"]]
    images, labels = [], []
    for sample in wds.WebDataset(urls, shardshuffle=False):
        images.append(np.asarray(Image.open(io.BytesIO(sample["png"])).convert("RGB")))
        labels.append(int(sample["cls"]))
    order = np.argsort(labels, kind="stable")
    np.savez(out / "sorted.npz", images=np.stack(images)[order], labels=np.array(labels)[order])
    shards = len(urls)
    span = f"train-{{000000..{shards - 1:06d}}}.tar"
    size = str(-(-len(labels) // shards))
    for name, order_flag in (("shuffled", "random"), ("sorted", "source")):
        if not (out / name / "train.json").exists():
            run("data", "convert", f"npz:{out / 'sorted.npz'}", str(out / name), "--shard-size", size,
                "--order", order_flag, "--no-progress")  # fmt: skip
    gz = out / "sorted_gz"
    gz.mkdir(exist_ok=True)
    for path in (out / "sorted").glob("train-*.tar"):
        (gz / path.name).write_bytes(gzip.compress(path.read_bytes()))
    shutil.copy(out / "sorted" / "train.json", gz / "train.json")
    return {name: str(out / name / span) for name in ("shuffled", "sorted", "sorted_gz")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=ROOT / "runs/sorted_shards")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    groups = {}
    for name, urls in layouts(args.out).items():
        ckpts = []
        for seed in args.seeds:
            run_dir = args.out / f"{name}_{seed}"
            if not (run_dir / "checkpoints/last.ckpt").exists():
                run("fit", "--config", "recipes/quickstart/supervised.yaml", "--seed_everything", str(seed),
                    "--data.init_args.seed", str(seed), "--data.init_args.train_urls", urls,
                    "--trainer.max_epochs", str(args.epochs), "--trainer.default_root_dir", str(run_dir),
                    "--trainer.enable_progress_bar", "false", "--trainer.logger", "false")  # fmt: skip
            ckpts.append(str(run_dir / "checkpoints/last.ckpt"))
        groups[name] = ",".join(ckpts)
    compared = [f"{name}={ckpts}" for name, ckpts in groups.items()]
    suite = "recipes/eval/quickstart.yaml"
    run("compare", *compared, "--baseline", "shuffled", "--suite", suite, "--out", str(args.out / "compare"))
    print(f"{(time.monotonic() - start) / 60:.1f} min; table: {args.out / 'compare/results.md'}")


if __name__ == "__main__":
    main()
