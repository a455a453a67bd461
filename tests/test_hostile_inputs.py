"""Hostile input, one row per case, each through the CLI as a user runs it: the command, the input that
attacks it (written by the row), the exit status and the line it must say. Never a traceback; a bad
item is skipped and counted with its reason, or the command says one `ssl-vit: error:` line and exits
2. The next reader of untrusted input adds rows here rather than a file of its own.

Inputs are tiny: shards of the digits' first 40 images (val-000000 as train, val-000001 as test), one
hostile sample added where the row says; suites of a one-block width-32 backbone."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
import yaml
from cli_helpers import one_step_fit_args, run_cli
from PIL import Image
from test_file_size_limit import LIMITED as FILE_SIZE_LIMIT

BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}
KNN = {"name": "knn", "kind": "knn", "k": 5}
SEG = {"name": "seg", "kind": "linear_seg", "steps": 2, "lrs": [0.1], "augmentation": "pretrain"}
PROBE = {"name": "lin", "kind": "linear_probe", "steps": 2, "lrs": [0.1]}


class Inputs:
    """Where a row writes its inputs (`root`, one folder per row) and the session's digits shards."""

    def __init__(self, root: Path, digits: Path) -> None:
        self.root, self.digits = root, digits

    def digits_samples(self, shard: str, n: int = 40) -> list[dict]:
        samples = wds.WebDataset(str(self.digits / shard), shardshuffle=False)
        return [{k: s[k] for k in ("__key__", "png", "cls")} for s, _ in zip(samples, range(n))]

    def shards(
        self, name: str, extra: dict | None = None, train: Callable[[dict], dict] | None = None
    ) -> Path:
        """`name/train-000000.tar` and `name/test-000000.tar` (no manifest): 40 digits each, the sample
        `extra` (a key and members; an image is added) appended to both, `train` applied to each
        training sample."""
        folder = self.root / name
        folder.mkdir(exist_ok=True)
        for split, shard in (("train", "val-000000.tar"), ("test", "val-000001.tar")):
            samples = self.digits_samples(shard)
            if split == "train" and train is not None:
                samples = [train(s) for s in samples]
            if extra is not None:
                samples.append({"__key__": "hostile", "png": samples[0]["png"], **extra})
            with wds.TarWriter(str(folder / f"{split}-000000.tar")) as sink:
                for sample in samples:
                    sink.write(sample)
        return folder

    def suite(self, name: str, data: Path, protocols: list[dict], **fields) -> Path:
        """A suite of `protocols` over the shards in `data`; `fields` override the suite's (and `data`'s
        block's, as `data_KEY`)."""
        block = {"train_urls": str(data / "train-000000.tar"), "test_urls": str(data / "test-000000.tar"),
                 "image_size": 32, "batch_size": 16, "num_workers": 0}  # fmt: skip
        block.update({k[5:]: v for k, v in fields.items() if k.startswith("data_")})
        suite = {"backbone": BACKBONE, "data": block, "resamples": 100, "protocols": protocols}
        suite.update({k: v for k, v in fields.items() if not k.startswith("data_")})
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(suite))
        return path

    def evaluate(self, name: str, suite: Path) -> list[str]:
        return ["evaluate", "scratch", "--suite", str(suite), "--out", str(self.root / f"{name}-out")]

    def segmentation(self, name: str, train_class: int | None = None, manifest: bool = False) -> Path:
        """Segmentation shards of 20 + 10 images of 32 px: train masks of four 16 px quarters of classes
        0-3 (all `train_class` when given), test masks every pixel 255 (ignored); with `manifest`, the
        split manifests `data convert` writes, whose `mask_pixels` say so."""
        folder = self.root / name
        folder.mkdir(exist_ok=True)
        rng = np.random.default_rng(0)
        for split, n in (("train", 20), ("test", 10)):
            pixels = {}
            with wds.TarWriter(str(folder / f"{split}-000000.tar")) as sink:
                for i in range(n):
                    mask = np.kron(rng.permutation(4).reshape(2, 2), np.ones((16, 16))).astype(np.uint8)
                    mask[:] = 255 if split == "test" else mask if train_class is None else train_class
                    image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                    for value, count in zip(*np.unique(mask, return_counts=True)):
                        pixels[str(value)] = pixels.get(str(value), 0) + int(count)
                    sink.write({"__key__": f"{split}-{i}", "png": png(image), "seg.png": png(mask)})
            if manifest:
                (folder / f"{split}.json").write_text(json.dumps({
                    "num_samples": n, "num_classes": 4, "class_names": list("abcd"), "image_size": [32, 32],
                    "class_counts": {"-1": n}, "masks": True, "mask_pixels": pixels,
                    "shards": [{"url": f"{split}-000000.tar", "num_samples": n}],
                }))  # fmt: skip
        return folder

    def tiles(self, name: str, n: int, labelled: bool = True) -> str:
        """`n` 8 px images (labels 0-3 in turn, or none) converted by `data convert`: their URLs."""
        rng = np.random.default_rng(0)
        labels = np.arange(n) % 4 if labelled else -np.ones(n, dtype=int)
        np.savez(
            self.root / f"{name}.npz",
            images=rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
            labels=labels,
        )
        run_cli("data", "convert", f"npz:{self.root / name}.npz", str(self.root / name), "--no-progress",
                "--shard-size", str(n))  # fmt: skip
        return str(self.root / name / "train-000000.tar")

    def unlabelled_tiles(self) -> str:
        """40 unlabelled tiles whose manifest names classes (a labelled set's split, its labels gone)."""
        url = self.tiles("unlabelled", 40, labelled=False)
        manifest = json.loads((self.root / "unlabelled" / "train.json").read_text())
        manifest.update(class_names=["a", "b"], num_classes=2)
        (self.root / "unlabelled" / "train.json").write_text(json.dumps(manifest))
        return url


def png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class Row:
    """A command on hostile input: `args` writes the input and gives the command line; the command exits
    `status`, its output holds `says` (the error line itself when `status` is 2 or `says` is one) in at
    most `lines` lines, and `then` checks what it wrote."""

    id: str
    args: Callable[[Inputs], list[str]]
    status: int
    says: str
    lines: int | None = None
    then: Callable[[Inputs], None] | None = None
    once: bool = False  # `says` is said exactly once
    prelude: str = ""  # run in the command's process first (`cli_helpers.start_cli`): a resource limit


# --- 1. json members and labels -------------------------------------------------------------------------

DEEP = {"json": b"[" * 200_000}  # 200 KB: nested past any parser's recursion limit
LABELS = {  # json labels that are no class index, each a bad sample
    "e400": b'{"label": 1e400}', "true": b'{"label": true}', "float": b'{"label": 3.9}',
    "nan": b'{"label": NaN}', "huge": b'{"label": ' + b"9" * 5000 + b"}", "object": b'{"label": {"a": 1}}',
    "digits": b'{"label": "1' + b"0" * 30 + b'"}',
}  # fmt: skip


def label_zoo(inputs: Inputs) -> list[str]:
    folder = inputs.shards("labels")
    with wds.TarWriter(str(folder / "zoo-000000.tar")) as sink:
        image = inputs.digits_samples("val-000000.tar", 1)[0]["png"]
        for key, data in LABELS.items():
            sink.write({"__key__": key, "png": image, "json": data})
        sink.write({"__key__": "fine", "png": image, "json": b'{"label": " 7 "}'})
    return ["data", "inspect", str(folder / "zoo-000000.tar")]


def every_label_listed(inputs: Inputs) -> None:
    proc = run_cli("data", "inspect", str(inputs.root / "labels" / "zoo-000000.tar"), check=False)
    problems = proc.stdout.split("problems:\n")[1].splitlines()
    assert len(problems) == len(LABELS) and "1 good samples" in proc.stdout, proc.stdout
    for key, line in zip(LABELS, problems):
        assert f": {key}: " in line and ("label does not parse" in line or "json does not parse" in line), (
            line
        )


def fit_on(inputs: Inputs, folder: Path, workers: int, batches: int = 2) -> list[str]:
    """`fit` of `batches` batches of 16 from `folder`'s training shard. Local shards are read in a
    seeded permutation of the epoch, so a row that must meet one sample reads all 41 (3 batches)."""
    return one_step_fit_args(
        inputs.digits, inputs.root / f"run-{folder.name}-{workers}",
        "--data.init_args.train_urls", str(folder / "train-000000.tar"), "--data.init_args.num_workers",
        str(workers), "--trainer.logger", "false", "--data.init_args.batch_size", "16",
        "--data.init_args.train_batches", str(batches),
    )  # fmt: skip


def knn_on(name: str, **extra) -> Callable[[Inputs], list[str]]:
    """`evaluate` of k-NN on the digits' shards with the sample `extra` added (`shards`' arguments)."""
    return lambda i: i.evaluate(name, i.suite(name, i.shards(name, **extra), [KNN]))


def convert_wds(inputs: Inputs) -> list[str]:
    shard = inputs.shards("deep", DEEP) / "train-000000.tar"
    return ["data", "convert", f"wds:{shard}", str(inputs.root / "deep-wds"), "--no-progress"]


DEEP_LINE = "hostile: json nests arrays or objects too deeply to parse"
JSON_ROWS = [
    Row("json-deep-inspect", lambda i: ["data", "inspect", str(i.shards("deep", DEEP) / "train-000000.tar")],
        1, DEEP_LINE),
    Row("json-labels-inspect", label_zoo, 1, "label does not parse: json label is inf",
        then=every_label_listed),
    Row("json-deep-evaluate", knn_on("deep", extra=DEEP), 0, f"skipping bad sample: {DEEP_LINE[:7]} in"),
    Row("json-deep-fit-2-workers", lambda i: fit_on(i, i.shards("deep", DEEP), 2, 3), 0, DEEP_LINE[9:]),
    Row("json-deep-convert-wds", convert_wds, 0, "wrote 40 samples (1 unreadable skipped)"),
    Row("json-true-evaluate", knn_on("true", extra={"json": b'{"label": true}'}), 0,
        "label does not parse: json label is True"),
]  # fmt: skip


# --- 2. classes that ask nothing ------------------------------------------------------------------------


def digits_suite(inputs: Inputs, name: str, protocols: list[dict]) -> list[str]:
    """A suite over the digits shards with their manifest (val 0-3 are the whole split)."""
    urls = {"data_train_urls": str(inputs.digits / "val-{000000..000003}.tar"),
            "data_test_urls": str(inputs.digits / "val-{000000..000003}.tar")}  # fmt: skip
    return inputs.evaluate(name, inputs.suite(name, inputs.digits, protocols, **urls))


def two_classes(sample: dict) -> dict:
    return {**sample, "cls": str(int(sample["cls"]) % 2).encode()}


def on_shards(name: str, protocol: dict, **shards) -> Callable[[Inputs], list[str]]:
    """`evaluate` of `protocol` on the digits' shards (`shards`: `Inputs.shards`' arguments)."""
    return lambda i: i.evaluate(name, i.suite(name, i.shards(name, **shards), [protocol]))


FEWSHOT = {"name": "fs", "kind": "fewshot", "shots": [1]}
CLASS_ROWS = [
    Row("classes-one", lambda i: digits_suite(i, "one", [{**KNN, "classes": [3]}]), 2,
        "protocol 'knn': classes [3] names one class"),
    Row("classes-beyond-manifest", lambda i: digits_suite(i, "beyond", [{**PROBE, "classes": [3, 42]}]), 2,
        "classes [3, 42]: train_urls hold no image of class 42 (their manifest counts 10 classes)"),
    Row("classes-absent-from-labels", on_shards("absent", {**FEWSHOT, "classes": [1, 5]}, train=two_classes),
        2, "train_urls hold no image of class 5 (none among their 40 images)"),
    Row("fewshot-more-shots-than-images", on_shards("shots", {**FEWSHOT, "shots": [30]}), 2,
        "30-shot needs 30 training samples per class"),
]  # fmt: skip


# --- 3. nothing to score --------------------------------------------------------------------------------


def strict_json(path: Path) -> dict:
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def null_results(inputs: Inputs) -> None:
    record = strict_json(inputs.root / "seg-out" / "results.json")
    assert record["results"] == {"seg_miou": None, "seg_pixel_acc": None}
    assert record["intervals"]["seg_miou"]["low"] is None and "seg_miou" in record["unscored"]


def comparison_written(inputs: Inputs) -> None:
    out = inputs.root / "seg-compare"
    for name in ("results.csv", "results.md", "verdicts.md", "differences.png", "bars.png"):
        assert (out / name).is_file(), name
    assert "| a | n/a | n/a |" in (out / "results.md").read_text()
    assert "nothing to score in 2 (seg_miou, seg_pixel_acc)" in (out / "verdicts.md").read_text()
    assert strict_json(out / "a" / "results.json")["results"]["seg_miou"] is None


def seg_on(name: str, command: str = "evaluate", **shards) -> Callable[[Inputs], list[str]]:
    """`evaluate`, or `compare` of scratch against itself as the baseline, of a segmentation probe on
    `Inputs.segmentation(name, **shards)` (four classes)."""

    def args(inputs: Inputs) -> list[str]:
        suite = inputs.suite(name, inputs.segmentation(name, **shards), [SEG], data_num_classes=4)
        if command == "evaluate":
            return inputs.evaluate(name, suite)
        out = str(inputs.root / f"{name}-compare")
        return ["compare", "a=scratch", "--scratch", "--baseline", "a", "--suite", str(suite), "--out", out]

    return args


NOT_SCORED = "seg_miou: no labelled pixel in the test masks"
SCORE_ROWS = [
    Row("seg-no-labelled-pixel-manifest", seg_on("segm", manifest=True), 2,
        "the test shards of data hold no labelled pixel (their manifest's mask_pixels)"),
    Row("seg-no-labelled-pixel-evaluate", seg_on("seg"), 0, f"ssl-vit: note: {NOT_SCORED}",
        then=null_results),
    Row("seg-no-labelled-pixel-compare", seg_on("seg", "compare"), 0, NOT_SCORED, then=comparison_written),
]  # fmt: skip


# --- 4. a split with no usable sample -------------------------------------------------------------------


def truncated(sample: dict) -> dict:
    return {**sample, "png": sample["png"][:40]}


def nothing_written(inputs: Inputs) -> None:
    assert not (inputs.root / "broken-compare").exists() and not (inputs.root / "broken-out").exists()
    assert not any(inputs.root.glob("run-broken-*"))


def broken(command: str, workers: int = 0) -> Callable[[Inputs], list[str]]:
    """`command` on the digits' shards with every training image cut to its first 40 bytes."""

    def args(inputs: Inputs) -> list[str]:
        folder = inputs.shards("broken", train=truncated)
        if command == "fit":
            return fit_on(inputs, folder, workers)
        suite = inputs.suite("broken", folder, [KNN], data_num_workers=workers)
        if command == "evaluate":
            return inputs.evaluate("broken", suite)
        return [
            "compare",
            "a=scratch",
            "b=scratch",
            "--suite",
            str(suite),
            "--out",
            str(inputs.root / "broken-compare"),
        ]

    return args


def masks_beyond(inputs: Inputs) -> list[str]:
    """Every training mask of class 9, with four classes."""
    suite = inputs.suite("beyond", inputs.segmentation("beyond", train_class=9), [SEG], data_num_classes=4)
    return inputs.evaluate("beyond", suite)


UNUSABLE = "no usable sample in a whole pass over 1 shard(s)"
IN_A_ROW = "1000 bad samples in a row and none usable"
UNUSABLE_ROWS = [
    Row("train-unusable-fit-0-workers", broken("fit"), 2, IN_A_ROW, lines=25, then=nothing_written),
    Row("train-unusable-fit-2-workers", broken("fit", 2), 2, IN_A_ROW, lines=40, then=nothing_written),
    Row("train-unusable-evaluate", broken("evaluate"), 2, UNUSABLE, lines=15, then=nothing_written),
    Row("train-unusable-compare", broken("compare", 2), 2, UNUSABLE, lines=15, then=nothing_written),
    Row("train-masks-beyond-num-classes", masks_beyond, 2, UNUSABLE, lines=15),
]  # fmt: skip


# --- 5. suites and claims of the wrong YAML types -------------------------------------------------------


def suite_mistake(name: str, protocols: list[dict] | None = None, **fields) -> Callable[[Inputs], list[str]]:
    return lambda i: i.evaluate(name, i.suite(name, i.shards("plain"), protocols or [KNN], **fields))


def claims_mistake(inputs: Inputs) -> list[str]:
    suite = inputs.suite("claimed", inputs.shards("plain"), [KNN])
    claims = inputs.root / "claims.yaml"
    claims.write_text(yaml.safe_dump({"claims": [{"says": ["x"], "rows": ["a"], "against": "scratch",
                                                  "columns": ["knn"]}]}))  # fmt: skip
    return ["compare", "a=scratch", "--scratch", "--suite", str(suite), "--claims", str(claims), "--out",
            str(inputs.root / "claimed-out")]  # fmt: skip


INJECTION = {"class_path": "subprocess.Popen", "init_args": {"args": "touch pwned"}}
TYPE_ROWS = [
    Row("kind-list", suite_mistake("kindlist", [{"name": "x", "kind": ["fewshot"]}]), 2,
        "protocol 'x': unknown protocol kind ['fewshot']: use one of fewshot, knn, linear_probe"),
    Row("kind-mapping", suite_mistake("kindmap", [{"name": "x", "kind": INJECTION}]), 2,
        "protocol 'x': unknown protocol kind {'class_path': 'subprocess.Popen'"),
    Row("suite-seed-negative", suite_mistake("seed", seed=-1), 2,
        "seed is -1: it should be an integer of 0 to"),
    Row("suite-resamples-huge", suite_mistake("resamples", resamples=10**30), 2,
        "resamples is 1000000000000000000000000000000: it should be an integer of 100 to 100,000"),
    Row("suite-urls-number", suite_mistake("urls", data_train_urls=12), 2,
        "train_urls is 12: give shard URLs as a string or a list of strings"),
    Row("suite-batch-size-null", suite_mistake("null", data_batch_size=None), 2, "data: batch_size is null"),
    Row("suite-mean-text", suite_mistake("mean", data_mean="0.5"), 2,
        "data: mean is '0.5': it should be a list"),
    Row("fewshot-seed-huge", suite_mistake("fsseed", [{**FEWSHOT, "seeds": [2**70]}]), 2,
        "seeds[0] is 1180591620717411303424: input should be less than 4294967296"),
    Row("claims-says-list", claims_mistake, 2, "claim 0: says is ['x']: input should be a valid string"),
]  # fmt: skip


# --- 6. mosaics ---------------------------------------------------------------------------------------


def no_outdir(path: Path) -> None:
    assert not path.exists(), f"{path} was left behind"


def mosaic(grid: int, tiles: Callable[[Inputs], str]) -> Callable[[Inputs], list[str]]:
    out = f"m{grid}"
    return lambda i: [
        "data",
        "convert",
        f"mosaic:{tiles(i)}",
        str(i.root / out),
        "--grid",
        str(grid),
        "--no-progress",
    ]


def four_hundred(inputs: Inputs) -> str:
    return inputs.tiles("t400", 400)


MOSAIC_ROWS = [
    Row("mosaic-fewer-than-a-grid", mosaic(21, four_hundred), 2,
        "fewer tiles than one grid: 400 images, a 21x21 grid needs 441"),
    Row("mosaic-left-out-tiles", mosaic(3, four_hundred), 0,
        "mosaic: the last 4 tiles do not fill a 3x3 grid and are left out", lines=2),
    Row("mosaic-unlabelled", mosaic(2, Inputs.unlabelled_tiles), 2, "none of the 40 tiles has a label",
        then=lambda i: no_outdir(i.root / "m2")),
]  # fmt: skip


def in_chans(given: list[str]) -> Callable[[Inputs], list[str]]:
    """A fit of the digits (one band: `channels 1`) with the backbone's in_chans given as `given`."""
    return lambda i: one_step_fit_args(
        i.digits, i.root / "run", "--data.init_args.channels", "1", *given, "--trainer.logger", "false"
    )


def no_run_dir(inputs: Inputs) -> None:
    assert not (inputs.root / "run").exists()


def img_size_in_a_config(inputs: Inputs) -> list[str]:
    """A fit of the digits with a `--config` file giving the backbone an image size the data has not."""
    config = inputs.root / "model.yaml"
    config.write_text("model:\n  init_args:\n    backbone:\n      img_size: 64\n")
    return in_chans(["--config", str(config)])(inputs)


# Fifth round: values the config links (the backbone takes the data's size and bands) given anyway.
LINK_ROWS = [
    Row("in-chans-contradicts-channels", in_chans(["--model.init_args.backbone.in_chans", "3"]), 2,
        "--model.init_args.backbone.in_chans 3 contradicts the data's channels (1)", then=no_run_dir),
    Row("in-chans-contradicts-channels-equals", in_chans(["--model.init_args.backbone.in_chans=13"]), 2,
        "--model.init_args.backbone.in_chans 13 contradicts the data's channels (1)", then=no_run_dir),
    Row("img-size-contradicts-image-size", in_chans(["--model.init_args.backbone.img_size", "64"]), 2,
        "--model.init_args.backbone.img_size 64 contradicts the data's image_size (32)", then=no_run_dir),
    Row("img-size-in-a-config-contradicts-image-size", img_size_in_a_config, 2,
        "--model.init_args.backbone.img_size 64 (in ", then=no_run_dir),
]  # fmt: skip


# --- 7. damaged members, files and disks: each said in one line, or counted once ----------------------


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def npy_shard(inputs: Inputs, name: str, arrays: dict[str, bytes]) -> Path:
    """`name/train-000000.tar` of one `npy` member a sample (`arrays`: key -> bytes), with the manifest of
    a set written before manifests recorded `channels`."""
    folder = inputs.root / name
    folder.mkdir()
    with wds.TarWriter(str(folder / "train-000000.tar")) as sink:
        for key, data in arrays.items():
            sink.write({"__key__": key, "npy": data, "cls": "0"})
    shards = [{"url": "train-000000.tar", "num_samples": len(arrays)}]
    (folder / "train.json").write_text(
        json.dumps({"num_samples": len(arrays), "num_classes": 1, "shards": shards})
    )
    return folder / "train-000000.tar"


def band_counts(inputs: Inputs) -> list[str]:
    """Members of 4 bands, then of 13."""
    rng = np.random.default_rng(0)
    arrays = {
        f"s{i}": npy(rng.integers(0, 1000, (8, 8, 4 if i < 2 else 13), dtype=np.uint16)) for i in range(4)
    }
    return ["data", "inspect", str(npy_shard(inputs, "bands", arrays)), "--stats"]


def manifest_untouched(inputs: Inputs) -> None:
    assert "band_stats" not in json.loads((inputs.root / "bands" / "train.json").read_text())


def damaged_header(inputs: Inputs) -> list[str]:
    """Its header's length field says 60,000 bytes: numpy refuses it in three lines."""
    rng = np.random.default_rng(0)
    good = npy(rng.normal(size=(8, 8, 2)).astype(np.float32))
    damaged = bytearray(npy(rng.normal(size=(64, 64, 4)).astype(np.float32)))
    damaged[8:10] = (60_000).to_bytes(2, "little")
    return [
        "data",
        "inspect",
        str(npy_shard(inputs, "header", {"s0": good, "s1": bytes(damaged), "s2": good})),
    ]


def looped_tiff() -> bytes:
    """Two pages, the second's next-IFD offset pointing back to the first."""
    import tifffile

    buf = io.BytesIO()
    with tifffile.TiffWriter(buf) as tif:
        for value in (1, 2):
            tif.write(np.full((8, 8), value, dtype=np.uint16), contiguous=False)
    data = bytearray(buf.getvalue())
    with tifffile.TiffFile(io.BytesIO(bytes(data))) as tif:
        second = tif.pages[1].offset
    tags = int.from_bytes(data[second : second + 2], "little")
    data[second + 2 + 12 * tags : second + 6 + 12 * tags] = data[4:8]  # the first IFD's offset
    return bytes(data)


def tiffs_with_a_loop(inputs: Inputs) -> list[str]:
    import tifffile

    folder = inputs.root / "tifs" / "a"
    folder.mkdir(parents=True)
    tifffile.imwrite(folder / "0.tif", np.full((8, 8), 3, dtype=np.uint16))
    (folder / "1.tif").write_bytes(looped_tiff())
    return ["data", "convert", f"tiff:{inputs.root / 'tifs'}", str(inputs.root / "out"), "--no-progress"]


def one_written_one_skipped(inputs: Inputs) -> None:
    manifest = json.loads((inputs.root / "out" / "train.json").read_text())
    assert manifest["num_samples"] == 1 and manifest["skipped"] == 1


def tiff_member_with_a_loop(inputs: Inputs) -> list[str]:
    shard = inputs.root / "loop-000000.tar"
    with wds.TarWriter(str(shard)) as sink:
        sink.write({"__key__": "looped", "tif": looped_tiff(), "cls": "0"})
    return ["data", "inspect", str(shard)]


PARQUET_ROWS = 200  # a row group


def damaged_row_group(inputs: Inputs) -> list[str]:
    """Two row groups of 200 PNGs in a Hub-style snapshot, the data page of the second's overwritten."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    images = [png(rng.integers(0, 256, (8, 8), dtype=np.uint8)) for _ in range(2 * PARQUET_ROWS)]
    path = inputs.root / "snap" / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    table = pa.table({"image": images, "label": [i % 2 for i in range(len(images))]})
    pq.write_table(table, path, row_group_size=PARQUET_ROWS, use_dictionary=False)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    raw = bytearray(path.read_bytes())
    raw[column.data_page_offset : column.data_page_offset + 16] = b"\xff" * 16
    path.write_bytes(bytes(raw))
    (inputs.root / "images.json").write_text(json.dumps([image.hex() for image in images[:PARQUET_ROWS]]))
    return ["data", "convert", f"hf:{inputs.root / 'snap'}", str(inputs.root / "out"), "--image-column",
            "image", "--label-column", "label", "--no-progress"]  # fmt: skip


def first_row_group_written(inputs: Inputs) -> None:
    manifest = json.loads((inputs.root / "out" / "train.json").read_text())
    assert manifest["num_samples"] == PARQUET_ROWS and manifest["skipped"] == PARQUET_ROWS
    urls = [str(inputs.root / "out" / s["url"]) for s in manifest["shards"]]
    written = [s["png"].hex() for s in wds.WebDataset(urls, shardshuffle=False)]
    assert written == json.loads((inputs.root / "images.json").read_text())  # in order, bytes as stored


def constant_band(inputs: Inputs) -> list[str]:
    """`compare` of two checkpoints on bands whose middle one is constant, normalised by band_stats."""
    import tifffile

    rng = np.random.default_rng(0)
    folder = inputs.root / "bands"
    for split, n in (("train", 8), ("test", 4)):
        for label in range(2):
            (inputs.root / split / str(label)).mkdir(parents=True)
            for i in range(n):
                image = rng.integers(0, 1000, (32, 32, 3), dtype=np.uint16)
                image[..., 1] = 7
                tifffile.imwrite(
                    inputs.root / split / str(label) / f"{i}.tif", image, photometric="minisblack"
                )
        run_cli(
            "data", "convert", f"tiff:{inputs.root / split}", str(folder), "--split", split, "--no-progress"
        )
    suite = inputs.suite("constant", folder, [KNN], data_channels=3, data_mean="auto", data_std="auto")
    return ["compare", "a=scratch", "b=scratch", "--suite", str(suite), "--out", str(inputs.root / "out")]


def convert_digits(inputs: Inputs) -> list[str]:
    """The digits' 4 validation shards into shards of 20 (61-71 KB each, in the digits' order)."""
    source = f"wds:{inputs.digits}/val-{{000000..000003}}.tar"
    return ["data", "convert", source, str(inputs.root / "out"), "--shard-size", "20", "--no-progress"]


def resumes_where_the_limit_stopped(inputs: Inputs) -> None:
    """No manifest; the progress record names exactly the finished shards, which the same command
    continues from without the limit."""
    out = inputs.root / "out"
    assert not (out / "train.json").exists()
    record = json.loads((out / ".train.partial" / "progress.json").read_text())
    finished = {s["url"]: s["bytes"] for s in record["shards"]}
    assert finished and {p.name: p.stat().st_size for p in (out / ".train.partial").glob("*.tar")} == finished
    proc = run_cli(*convert_digits(inputs))
    assert f"continuing the interrupted conversion after its {len(finished)} finished shards" in proc.stderr
    expected = json.loads((inputs.digits / "val.json").read_text())["num_samples"]
    assert json.loads((out / "train.json").read_text())["num_samples"] == expected


def wds_without_class_names(inputs: Inputs) -> list[str]:
    """The digits' validation shards beside a manifest without the optional `class_names`, converted."""
    folder = inputs.root / "no-names"
    folder.mkdir()
    for shard in inputs.digits.glob("val-*.tar"):
        shutil.copy(shard, folder / shard.name)
    manifest = json.loads((inputs.digits / "val.json").read_text())
    del manifest["class_names"]
    (folder / "val.json").write_text(json.dumps(manifest))
    return ["data", "convert", f"wds:{folder}/val-{{000000..000003}}.tar", str(inputs.root / "no-names-out"),
            "--no-progress"]  # fmt: skip


def converted_with_the_labels(inputs: Inputs) -> None:
    written = json.loads((inputs.root / "no-names-out" / "train.json").read_text())
    expected = json.loads((inputs.digits / "val.json").read_text())
    assert written["num_samples"] == expected["num_samples"] and written["num_classes"] == 10


TOO_LARGE = (
    "ssl-vit: error: file too large (File too large: the file size limit): raise the limit (ulimit -f)"
)
DAMAGED_ROWS = [
    Row("bands-mixed-inspect-stats", band_counts, 2,
        "train-000000.tar: sample s2 has 13 bands where the images before it have 4: band_stats are of one "
        "band count", then=manifest_untouched),
    Row("npy-header-damaged-inspect", damaged_header, 1,
        "s1: npy header does not parse (ValueError: Header info length (60000) is large and may not be safe "
        "to load securely.)", lines=5),
    Row("tiff-ifd-loop-convert", tiffs_with_a_loop, 0,
        "1.tif: is a damaged TIFF (tifffile: invalid circular reference to IFD 1 at offset=", lines=3,
        once=True, then=one_written_one_skipped),
    Row("tiff-ifd-loop-inspect", tiff_member_with_a_loop, 1,
        "looped: tif is a damaged TIFF (tifffile: invalid circular reference to IFD 1", lines=5, once=True),
    Row("parquet-row-group-damaged-convert", damaged_row_group, 0,
        f"data/train-00000-of-00001.parquet row group 1 ({PARQUET_ROWS} rows): ", lines=3, once=True,
        then=first_row_group_written),
    Row("constant-band-compare", constant_band, 0,
        "band(s) 1 are constant over the manifest's band_stats (std 0): normalised with std 1", once=True),
    Row("file-size-limit-convert", convert_digits, 1,
        f"{TOO_LARGE}, or give a --trainer.default_root_dir / --out / OUTDIR on a filesystem",
        lines=2, prelude=FILE_SIZE_LIMIT, then=resumes_where_the_limit_stopped),
    Row("wds-manifest-without-class-names-convert", wds_without_class_names, 0, "", lines=3,
        then=converted_with_the_labels),
]  # fmt: skip

ROWS = (
    JSON_ROWS + CLASS_ROWS + SCORE_ROWS + UNUSABLE_ROWS + TYPE_ROWS + MOSAIC_ROWS + LINK_ROWS + DAMAGED_ROWS
)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile")


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_hostile_input(row: Row, root: Path, digits_shards: Path):
    folder = root / row.id
    folder.mkdir()
    inputs = Inputs(folder, digits_shards)
    proc = run_cli(*row.args(inputs), cwd=folder, check=False, prelude=row.prelude)
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and proc.returncode == row.status, output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    if row.status == 2 or row.says.startswith("ssl-vit: error:"):
        assert errors == [proc.stderr.splitlines()[-1]] and row.says in errors[0], output[-3000:]
    else:
        assert not errors and row.says in output, output[-3000:]
    if row.lines is not None:
        assert output.count("\n") <= row.lines, output[-3000:]
    if row.once:
        assert output.count(row.says) == 1, output[-3000:]
    assert not (folder / "pwned").exists()
    if row.then is not None:
        row.then(inputs)
