"""`ssl-vit evaluate` and `ssl-vit compare` end to end, on digits shards and tiny checkpoints."""

import csv
import json
import shutil
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from cli_helpers import failing_evaluation
from PIL import Image

from ssl_vit.analysis.attention import attention_distance
from ssl_vit.analysis.images import read_images
from ssl_vit.checkpoints import load_backbone
from ssl_vit.cli.evaluate import parse_checkpoints, repeated_checkpoints
from ssl_vit.errors import UserError
from ssl_vit.evaluation.cache import FeatureCache
from ssl_vit.evaluation.suite import load_suite
from ssl_vit.models.vit import ViTConfig
from ssl_vit.report.tables import all_notes, grid_edge_notes
from ssl_vit.tasks import MaskedPatchPretraining, SupervisedPretraining

ROOT = Path(__file__).resolve().parents[2]
BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}


def save(model, path):
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def setup(digits_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    torch.manual_seed(0)
    config = ViTConfig(**BACKBONE)
    ckpts = {
        "mpp": save(MaskedPatchPretraining(config, preset="vit_mpp"), root / "mpp.ckpt"),
        "sup": save(SupervisedPretraining(config, num_classes=10), root / "sup.ckpt"),
    }
    # loads like any other; its evaluation fails (`FAIL_BROKEN`): one row's failure, the others kept
    shutil.copy(ckpts["mpp"], root / "broken.ckpt")
    ckpts["broken"] = str(root / "broken.ckpt")
    suite = {
        "backbone": BACKBONE,
        "data": {
            "train_urls": str(digits_shards / "train-{000000..000004}.tar"),
            "test_urls": str(digits_shards / "val-{000000..000003}.tar"),
            "image_size": 32,
            "batch_size": 128,
            "num_workers": 0,
        },
        "protocols": [
            {"name": "fewshot", "kind": "fewshot", "shots": [1, 5], "seeds": [0, 1]},
            {"name": "heldout", "kind": "fewshot", "shots": [5], "seeds": [0], "classes": [5, 6, 7, 8, 9]},
            {"name": "knn", "kind": "knn", "k": 5},
            {"name": "linear", "kind": "linear_probe", "epochs": 1, "lrs": [0.1, 0.3]},
        ],
    }
    (root / "suite.yaml").write_text(yaml.safe_dump(suite))
    return root, ckpts


FAIL_BROKEN = failing_evaluation("broken.ckpt")
# While the report is written (`writer.write_report`) loading a checkpoint raises, wherever the name was
# imported: the report draws the attention distances the ranks measured, and loads nothing itself.
NO_LOADING_IN_REPORT = """
import sys
from ssl_vit import checkpoints as _checkpoints
from ssl_vit.report import writer as _writer
_load, _write = _checkpoints.load_backbone, _writer.write_report
def _refuse(*args, **kwargs):
    raise RuntimeError("the report loaded a checkpoint")
def _write_report(*args, **kwargs):
    holders = [m for m in list(sys.modules.values()) if vars(m).get("load_backbone") is _load]
    for module in holders:
        module.load_backbone = _refuse
    try:
        return _write(*args, **kwargs)
    finally:
        for module in holders:
            module.load_backbone = _load
_writer.write_report = _write_report
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compare_writes_every_file_and_a_broken_checkpoint_is_a_failed_row(setup, cli):
    root, ckpts = setup
    out = root / "out"
    proc = cli(
        "compare",
        *[f"{k}={v}" for k, v in ckpts.items()],
        "--scratch",
        "--suite",
        str(root / "suite.yaml"),
        "--out",
        str(out),
        check=False,
        prelude=FAIL_BROKEN + NO_LOADING_IN_REPORT,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # one checkpoint failed
    for name in (
        "results.csv",
        "results.md",
        "fewshot.png",
        "bars.png",
        "attention_distance.png",
        "attention_distance.json",
        "mpp/results.json",
        "broken/error.txt",
    ):
        assert (out / name).is_file(), name
    rows = {row["name"]: row for row in csv.DictReader((out / "results.csv").open())}
    assert list(rows) == ["mpp", "sup", "broken", "scratch"]
    columns = ["fewshot_1shot", "fewshot_5shot", "heldout_5shot", "knn", "linear"]
    for name in ("mpp", "sup", "scratch"):
        assert rows[name]["error"] == ""
        assert all(0.0 <= float(rows[name][c]) <= 1.0 for c in columns), rows[name]
    assert rows["broken"]["error"] == "RuntimeError: injected failure" and rows["broken"]["knn"] == ""
    table = (out / "results.md").read_text()
    # Every column marks its best: in bold when clear, else the tied rows.
    assert "| broken | failed:" in table and table.count("**") // 2 + table.count("(tie)") >= len(columns)
    assert list((out / "wandb").glob("offline-run-*"))
    details = json.loads((out / "mpp/results.json").read_text())
    assert details["protocols"][0]["shots"] == [1, 5] and "best_lr" in details["details"]["linear"]
    # A grid of two lrs: a chosen lr that beats the other ends the grid, and results.md notes it (with
    # every other note on the records, in that order).
    records = [json.loads((out / name / "results.json").read_text()) for name in ("mpp", "sup", "scratch")]
    notes = all_notes(records)
    assert grid_edge_notes(records)
    assert table.endswith("\nNotes:\n\n" + "".join(f"- {note}\n" for note in notes))
    assert all(note in proc.stdout for note in notes)
    # Mean attention distance against depth: one curve per checkpoint that loaded (depth 1, 2 heads).
    attention = json.loads((out / "attention_distance.json").read_text())
    assert attention["images"] == 64 and list(attention["checkpoints"]) == ["mpp", "sup", "scratch"]
    farthest = 8 * 3 * 2**0.5  # 4 x 4 patches of 8 pixels, corner to corner
    for curve in attention["checkpoints"].values():
        (heads,) = curve["per_head"]
        assert len(heads) == 2 and all(0 < d < farthest for d in heads)
        assert curve["mean_per_layer"] == [pytest.approx(sum(heads) / 2, abs=1e-3)]
    # the heads' distances on the first 64 test images, as `analysis.attention` measures them alone
    suite = load_suite(root / "suite.yaml")
    images = read_images(FeatureCache.datamodule_of(suite.datasets["data"]), "test", 64)[0]
    backbone = load_backbone(ckpts["sup"], suite.backbone)[0].eval()
    (expected,) = attention_distance(backbone, images, batch_size=64).tolist()
    assert attention["checkpoints"]["sup"]["per_head"] == [pytest.approx(expected, abs=1e-3)]
    assert len(details["attention_distance"]["per_head"]) == 1  # each run's record holds its own
    with Image.open(out / "attention_distance.png") as picture:
        assert picture.format == "PNG" and picture.size == (600, 450)


@pytest.mark.slow
def test_evaluate_writes_results_json(setup, cli):
    root, ckpts = setup
    suite = yaml.safe_load((root / "suite.yaml").read_text())
    suite["protocols"] = suite["protocols"][:3]  # the frozen-feature ones
    (root / "frozen.yaml").write_text(yaml.safe_dump(suite))
    cli("evaluate", ckpts["sup"], "--suite", str(root / "frozen.yaml"), "--out", str(root / "eval"))
    record = json.loads((root / "eval/results.json").read_text())
    assert set(record["results"]) == {"fewshot_1shot", "fewshot_5shot", "heldout_5shot", "knn"}
    assert record["backbone"]["variant"] == "S/8"


def test_bad_suites_and_arguments_are_one_line_errors(tmp_path, cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {"data": {"train_urls": "a", "test_urls": "b"}, "protocols": [{"name": "x", "kind": "magic"}]}
        )
    )
    with pytest.raises(
        UserError, match="use one of fewshot, knn, linear_probe, attentive_probe, linear_seg, finetune"
    ):
        load_suite(bad)
    bad.write_text(
        yaml.safe_dump(
            {
                "data": {"train_urls": "a", "test_urls": "b"},
                "protocols": [{"name": "x", "kind": "knn", "neighbours": 3}],
            }
        )
    )
    with pytest.raises(UserError, match="unknown keys \\['neighbours'\\]"):
        load_suite(bad)
    with pytest.raises(UserError, match="NAME=CKPT"):
        parse_checkpoints(["runs/a.ckpt"], scratch=0)
    assert parse_checkpoints(["a=x.ckpt"], scratch=1) == {"a": ["x.ckpt"], "scratch": ["scratch"]}
    assert parse_checkpoints(["a=x.ckpt,y.ckpt"], scratch=2) == {
        "a": ["x.ckpt", "y.ckpt"],
        "scratch": ["scratch", "scratch"],
    }
    proc = cli(
        "evaluate", "scratch", "--suite", str(tmp_path / "missing.yaml"), "--out", str(tmp_path), check=False
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_suites_with_several_datasets_route_each_protocol(tmp_path):
    data = {"train_urls": "a-{0..1}.tar", "test_urls": "b.tar"}
    path = tmp_path / "multi.yaml"
    path.write_text(yaml.safe_dump({
        "datasets": {"cifar10": data, "pets": data},
        "protocols": [
            {"name": "c10", "kind": "knn"},
            {"name": "pets_fs", "kind": "fewshot", "dataset": "pets"},
        ],
    }))  # fmt: skip
    suite = load_suite(path)
    assert [p.dataset for p in suite.protocols] == ["cifar10", "pets"]
    assert suite.columns() == ["c10", "pets_fs_1shot", "pets_fs_5shot", "pets_fs_10shot", "pets_fs_25shot"]
    path.write_text(yaml.safe_dump({"datasets": {"cifar10": data}, "protocols": [
        {"name": "x", "kind": "knn", "dataset": "imagenet"}]}))  # fmt: skip
    with pytest.raises(UserError, match="names dataset 'imagenet'; valid: cifar10"):
        load_suite(path)


@pytest.mark.parametrize("suite", sorted(ROOT.glob("recipes/eval/*.yaml")), ids=lambda p: p.name)
def test_every_shipped_suite_parses(suite):
    parsed = load_suite(suite)
    assert parsed.protocols and parsed.columns()
    assert suite.read_text().startswith("# ssl-vit compare")


@pytest.mark.slow
def test_scratch_rows_are_reproducible(setup):
    """The suite's seed fixes the scratch initialisation, so a rerun gives the same numbers."""
    from ssl_vit.evaluation.suite import evaluate

    root, _ = setup
    suite = load_suite(root / "suite.yaml")
    suite.protocols = [p for p in suite.protocols if p.kind == "knn"]
    first, again = (evaluate("scratch", suite).record["results"] for _ in range(2))
    assert first == again


def test_labels_reuse_any_feature_pass_of_the_split(digits_shards, monkeypatch):
    """Trained protocols ask for the labels only: they must not cost another pass over the data."""
    from ssl_vit.evaluation import cache as cache_module

    calls = []
    real = cache_module.extract_feature_set
    monkeypatch.setattr(
        cache_module, "extract_feature_set", lambda *a, **k: calls.append(a[2]) or real(*a, **k)
    )
    data = {"train_urls": str(digits_shards / "val-{000000..000003}.tar"), "test_urls": "unused",
            "image_size": 32, "batch_size": 128, "num_workers": 0}  # fmt: skip
    config = ViTConfig(**BACKBONE)
    cache = cache_module.FeatureCache(config.build(), config, data, ("mean", "cls"))
    features = cache.get("train", "mean")
    assert torch.equal(cache.labels("train"), features.y) and cache.num_classes() == 10
    assert torch.equal(cache.get("train", "cls").y, features.y)
    assert calls == [("mean", "cls")]


@pytest.fixture(scope="module")
def frozen_suite(setup):
    """The setup's suite with its frozen-feature protocols only and 200 resamples: fast to compare."""
    root, ckpts = setup
    suite = yaml.safe_load((root / "suite.yaml").read_text())
    suite["protocols"] = suite["protocols"][:3]
    suite["resamples"] = 200
    (root / "frozen_ci.yaml").write_text(yaml.safe_dump(suite))
    # A checkpoint saved before tasks recorded their cost.
    old = torch.load(ckpts["mpp"], weights_only=True)
    del old["ssl_vit_cost"]
    torch.save(old, root / "old.ckpt")
    return root / "frozen_ci.yaml", {**ckpts, "old": str(root / "old.ckpt")}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compare_with_a_baseline_and_groups_of_runs(frozen_suite, tmp_path, cli):
    suite, ckpts = frozen_suite
    out = tmp_path / "out"
    proc = cli(
        "compare",
        f"mpp={ckpts['mpp']}",
        f"same={ckpts['mpp']}",
        f"group={ckpts['mpp']},{ckpts['sup']}",
        f"old={ckpts['old']}",
        "--scratch", "2",
        "--baseline", "mpp",
        "--suite", str(suite),
        "--out", str(out),
    )  # fmt: skip
    columns = ["fewshot_1shot", "fewshot_5shot", "heldout_5shot", "knn"]
    rows = {row["name"]: row for row in csv.DictReader((out / "results.csv").open())}
    assert list(rows) == ["mpp", "same", "group", "old", "scratch"]
    for row in rows.values():
        for c in columns:
            assert float(row[f"{c}_low"]) <= float(row[c]) <= float(row[f"{c}_high"]), (row["name"], c)
    # A group's value is the mean of its runs' (each run's results.json under NAME/1, NAME/2).
    runs = [json.loads((out / f"group/{i}/results.json").read_text())["results"] for i in (1, 2)]
    for c in columns:
        assert float(rows["group"][c]) == pytest.approx((runs[0][c] + runs[1][c]) / 2)
        assert float(rows["group"][f"{c}_run_std"]) == pytest.approx(abs(runs[0][c] - runs[1][c]) / 2)
    # Two scratch initialisations are two different draws.
    scratch = [json.loads((out / f"scratch/{i}/results.json").read_text())["results"] for i in (1, 2)]
    assert scratch[0] != scratch[1] and rows["scratch"]["runs"] == "2"
    # Cost: recorded (0 steps: these checkpoints were saved untrained) or n/a.
    assert float(rows["mpp"]["steps"]) == 0 and rows["old"]["steps"] == "" and rows["old"]["flops"] == ""
    assert json.loads((out / "mpp/results.json").read_text())["cost"]["images"] == 0
    table = (out / "results.md").read_text()
    assert table in proc.stdout  # the CLI prints the tables
    main, differences = table.split("Paired differences against mpp")
    cells = [line for line in main.splitlines() if line.startswith("| ")]
    assert sum(line.count(" ± ") for line in cells) == 5 * len(columns) and "| group (2 runs) |" in main
    assert "| n/a | n/a | n/a | n/a |" in main  # old
    assert "**" in main or "(tie)" in main
    diff_rows = {
        line.split(" | ")[0].strip("| "): line
        for line in differences.splitlines()
        if line.startswith("| ") and " [" in line
    }
    assert list(diff_rows) == ["same", "group", "old", "scratch"]
    # The checkpoint against itself: exactly zero, zero width, within noise.
    assert diff_rows["same"].count("+0.0 [+0.0, +0.0] noise") == len(columns)
    marks = [cell.split()[-1] for line in diff_rows.values() for cell in line.strip("| ").split(" | ")[1:]]
    assert set(marks) <= {"win", "loss", "noise"} and len(marks) == 4 * len(columns)
    for picture in ("compute.png", "differences.png", "fewshot.png", "bars.png"):
        with Image.open(out / picture) as image:
            assert image.format == "PNG", picture
    # The W&B run holds the same table, intervals and cost included, and the paired differences.
    media = next((out / "wandb").glob("offline-run-*")) / "files" / "media" / "table"
    results = json.loads(next(media.glob("results_*.table.json")).read_text())
    header = next(csv.reader((out / "results.csv").open()))
    assert results["columns"] == header and [r[0] for r in results["data"]] == list(rows)
    for logged in results["data"]:
        for name, value in zip(header, logged, strict=True):
            if name.endswith(("_low", "_high")) and value is not None:
                assert value == pytest.approx(float(rows[logged[0]][name])), name
    diffs = json.loads(next(media.glob("paired_differences_*.table.json")).read_text())
    same = dict(zip(diffs["columns"], next(r for r in diffs["data"] if r[0] == "same"), strict=True))
    for c in columns:
        assert (same[c], same[f"{c}_low"], same[f"{c}_high"], same[f"{c}_verdict"]) == (0, 0, 0, "noise")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["a=scratch", "--baseline", "b"], "--baseline 'b' names no checkpoint; valid: a"),
        (["a=x.ckpt,,y.ckpt"], "'a=x.ckpt,,y.ckpt' is not NAME=CKPT or NAME=CKPT1,CKPT2,..."),
        (["a="], "'a=' is not NAME=CKPT"),
    ],
)
def test_compare_argument_mistakes_are_one_line_and_write_nothing(arguments, message, tmp_path, cli):
    out = tmp_path / "out"
    proc = cli("compare", *arguments, "--suite", str(tmp_path / "s.yaml"), "--out", str(out), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("problem", ["missing", "not-a-checkpoint", "architecture", "shard"])
def test_compare_checks_every_input_before_evaluating_any(problem, setup, tmp_path, cli):
    """A mistake in the last input stops compare at once, in one line naming it: nothing evaluated (no
    progress line), nothing written."""
    root, ckpts = setup
    suite = yaml.safe_load((root / "suite.yaml").read_text())
    second, words = ckpts["sup"], None
    if problem == "missing":
        second, words = str(tmp_path / "nowhere.ckpt"), "b: "
    elif problem == "not-a-checkpoint":
        (tmp_path / "junk.ckpt").write_bytes(b"this is not a checkpoint")
        second, words = str(tmp_path / "junk.ckpt"), "b: "
    elif problem == "architecture":
        config = ViTConfig(**{**BACKBONE, "width": 64})
        second, words = save(SupervisedPretraining(config, num_classes=10), tmp_path / "wide.ckpt"), "b: "
    else:
        suite["data"]["test_urls"] = str(tmp_path / "gone-{000000..000001}.tar")
        words = "test_urls: shard"
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    proc = cli("compare", f"a={ckpts['mpp']}", f"b={second}", "--suite", str(tmp_path / "suite.yaml"),
               "--out", str(out), check=False)  # fmt: skip
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("ssl-vit: error: ") and words in proc.stderr, proc.stderr
    assert "features of" not in proc.stdout and not out.exists()


def test_two_samples_of_a_split_with_one_key_are_one_line(digits_shards, tmp_path, cli):
    """The protocols pair images and hold some out by key: a split whose shards repeat a key (the same
    split converted twice, given together) is refused in one line, nothing written."""
    suite = yaml.safe_load((ROOT / "recipes/eval/quickstart.yaml").read_text())
    twice = [str(digits_shards / "val-000000.tar"), str(digits_shards / "val-000000.tar")]
    suite["data"].update(train_urls=twice, test_urls=str(digits_shards / "val-000001.tar"), num_workers=0)
    suite["protocols"] = [{"name": "knn", "kind": "knn", "k": 5}]
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(tmp_path / "suite.yaml"), "--out", str(out), check=False)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert "two samples of train_urls share the key" in proc.stderr and not out.exists()


def test_a_checkpoint_given_twice_is_a_warning_and_a_url_suite_is_one_line(setup, tmp_path, cli):
    root, ckpts = setup
    parsed = parse_checkpoints([f"a={ckpts['sup']}", f"b={ckpts['mpp']},{ckpts['sup']}"], scratch=2)
    assert repeated_checkpoints(parsed) == [
        f"{ckpts['sup']} is given 2 times (a, b/2): it is evaluated each time, and its rows are one "
        "checkpoint, not independent runs"
    ]
    proc = cli("compare", f"a={ckpts['sup']}", "--suite", "http://example.org/suite.yaml", "--out",
               str(tmp_path / "out"), check=False)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr == (
        "ssl-vit: error: suite http://example.org/suite.yaml is a URL: give a local file (fetch it first, "
        "e.g. with curl -o FILE)\n"
    )


def test_a_trained_protocol_over_shards_without_a_manifest_asks_for_steps(
    setup, digits_shards, tmp_path, cli
):
    """Shards without a manifest cannot size an epoch: the suite's protocol is asked for `steps` (not
    the data module's train_batches, which a suite does not take), before anything runs."""
    shards = tmp_path / "shards"  # (not where --out goes: an --out inside the shards' folder is refused)
    shards.mkdir()
    for shard in ("train-000000.tar", "val-000000.tar"):
        shutil.copy(digits_shards / shard, shards / shard.replace("-", "_"))  # no SPLIT-NNNNNN name
    suite = yaml.safe_load((setup[0] / "suite.yaml").read_text())
    suite["data"].update(
        train_urls=str(shards / "train_000000.tar"), test_urls=str(shards / "val_000000.tar")
    )
    suite["protocols"] = [{"name": "linear", "kind": "linear_probe", "epochs": 1, "lrs": [0.1]}]
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    proc = cli("evaluate", "scratch", "--suite", str(tmp_path / "suite.yaml"), "--out", str(tmp_path / "out"),
               check=False)  # fmt: skip
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert (
        "protocol 'linear': train_urls of data have no manifest to size an epoch by: give the protocol "
        "steps" in proc.stderr
    )
    suite["protocols"][0] = {"name": "linear", "kind": "linear_probe", "steps": 2, "lrs": [0.1]}
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    cli("evaluate", "scratch", "--suite", str(tmp_path / "suite.yaml"), "--out", str(tmp_path / "out"))
