"""`ssl-vit data convert imagenet:DIR` on a tiny fake ILSVRC-2012 tree, through the CLI: train class
folders, val flat with Kaggle's solution file or the devkit's ground truth, val in class folders, and
one-line errors (exit 2, nothing written) for trees it cannot read."""

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

WNIDS = ["n01440764", "n01443537", "n01484850"]  # sorted: labels 0, 1, 2
VAL_WNIDS = ["n01484850", "n01440764", "n01443537", "n01484850"]  # val images 1-4


def jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(
        buf, "JPEG"
    )
    return buf.getvalue()


@pytest.fixture
def tree(tmp_path) -> Path:
    """DIR/train/WNID/*.JPEG (2 per class), DIR/val/ILSVRC2012_val_0000000{1..4}.JPEG, no ground truth."""
    top = tmp_path / "imagenet"
    for c, wnid in enumerate(reversed(WNIDS)):  # created out of order: the index is the sorted order
        (top / "train" / wnid).mkdir(parents=True)
        for i in range(2):
            (top / "train" / wnid / f"{wnid}_{i}.JPEG").write_bytes(jpeg(10 * c + i))
    (top / "val").mkdir()
    for i in range(1, 5):
        (top / "val" / f"ILSVRC2012_val_{i:08d}.JPEG").write_bytes(jpeg(100 + i))
    return top


def write_solution(top: Path) -> None:
    rows = [f"ILSVRC2012_val_{i:08d},{w} 1 2 10 11 {w} 3 3 9 9" for i, w in enumerate(VAL_WNIDS, start=1)]
    (top / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "\n".join(rows[::-1]) + "\n")


def write_devkit(top: Path) -> None:
    """The devkit's ground truth (ILSVRC2012_IDs, one per line) and meta.mat, whose IDs are not in wnid
    order (as in the real one) and which holds a non-leaf synset beyond ID 1000."""
    from scipy.io import savemat

    ids = {"n01484850": 1, "n01440764": 2, "n01443537": 3, "n00001740": 1001}
    fields = [("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("num_children", "O")]
    synsets = np.empty((len(ids), 1), dtype=fields)
    for row, (wnid, i) in enumerate(ids.items()):
        synsets[row, 0] = (i, wnid, "words", 0 if i <= 1000 else 3)
    data = top / "ILSVRC2012_devkit_t12" / "data"
    data.mkdir(parents=True)
    savemat(data / "meta.mat", {"synsets": synsets})
    (data / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{ids[w]}\n" for w in VAL_WNIDS))


def read(outdir: Path, split: str) -> tuple[dict, list[tuple[bytes, int]]]:
    manifest = json.loads((outdir / f"{split}.json").read_text())
    urls = [str(outdir / s["url"]) for s in manifest["shards"]]
    got = [(s["jpg"], int(s["cls"])) for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False)]
    return manifest, got


@pytest.mark.parametrize("truth", ["kaggle", "devkit", "class-folders"])
def test_train_and_val_labels(cli, tree, tmp_path, truth):
    if truth == "kaggle":
        write_solution(tree)
    elif truth == "devkit":
        write_devkit(tree)
    else:  # val sorted into class folders (valprep.sh)
        for i, wnid in enumerate(VAL_WNIDS, start=1):
            (tree / "val" / wnid).mkdir(exist_ok=True)
            shutil.move(tree / "val" / f"ILSVRC2012_val_{i:08d}.JPEG", tree / "val" / wnid)
    out = tmp_path / "out"
    for split in ("train", "val"):
        cli(
            "data",
            "convert",
            "--order",
            "source",
            f"imagenet:{tree}",
            str(out),
            "--split",
            split,
            "--format",
            "jpg",
            "--no-progress",
        )
    manifest, train = read(out, "train")
    assert manifest["class_names"] == WNIDS and manifest["num_classes"] == 3
    assert train == [(jpeg(10 * (2 - c) + i), c) for c in range(3) for i in range(2)]  # bytes kept
    manifest, val = read(out, "val")
    assert manifest["class_names"] == WNIDS
    labels = [WNIDS.index(w) for w in VAL_WNIDS]
    if truth == "class-folders":
        assert sorted(val) == sorted((jpeg(100 + i), c) for i, c in enumerate(labels, start=1))
    else:
        assert val == [(jpeg(100 + i), c) for i, c in enumerate(labels, start=1)]


def garble_solution(top: Path) -> None:
    write_solution(top)
    text = (top / "LOC_val_solution.csv").read_text().replace(",n01440764", ",tench")
    (top / "LOC_val_solution.csv").write_text(text)


def drop_a_label(top: Path) -> None:
    write_solution(top)
    lines = (top / "LOC_val_solution.csv").read_text().splitlines()
    (top / "LOC_val_solution.csv").write_text("\n".join(line for line in lines if "val_00000003" not in line))


@pytest.mark.parametrize(
    "break_it, split, words",
    [
        (lambda top: shutil.rmtree(top / "train"), "train", ["/train", "ILSVRC2012_img_train.tar"]),
        (lambda top: None, "val", ["no ground truth", "LOC_val_solution.csv", "class folders"]),
        (garble_solution, "val", ["LOC_val_solution.csv:4", "IMAGE_ID,nXXXXXXXX"]),
        (drop_a_label, "val", ["ILSVRC2012_val_00000003.JPEG: no label in", "LOC_val_solution.csv"]),
        (lambda top: (top / "ILSVRC2012_validation_ground_truth.txt").write_text("1\n"), "val", ["meta.mat"]),
        (lambda top: None, "test", ["splits 'train' and 'val'"]),
    ],
    ids=["no-train-folder", "no-ground-truth", "garbled-csv", "unlabelled-val-image", "no-meta", "bad-split"],
)
def test_unreadable_trees_are_one_line_errors_and_nothing_is_written(
    cli, tree, tmp_path, break_it, split, words
):
    break_it(tree)
    proc = cli(
        "data",
        "convert",
        "--order",
        "source",
        f"imagenet:{tree}",
        str(tmp_path / "out"),
        "--split",
        split,
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("ssl-vit: error: ")
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
