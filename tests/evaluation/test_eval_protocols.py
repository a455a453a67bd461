"""The trained protocols' keys (optimizer, schedule, augmentation, ...) and label fractions: checked when
the suite loads, recorded in results.json, and what they train on."""

import csv
import json
from collections import Counter

import pytest
import pytorch_lightning as pl
import torch
import yaml
from cli_helpers import run_cli
from PIL import Image

from ssl_vit.evaluation.trained import label_subset
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import SupervisedPretraining

BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}
LINEAR = {"name": "linear", "kind": "linear_probe", "epochs": 1, "lrs": [0.1, 0.3]}
FINETUNE = {"name": "ft", "kind": "finetune", "epochs": 1}


def write_suite(path, shards, protocols, train="val-{000000..000001}.tar", batch_size=64):
    suite = {
        "backbone": BACKBONE,
        "data": {
            "train_urls": str(shards / train),
            "test_urls": str(shards / "val-{000002..000003}.tar"),
            "image_size": 32,
            "batch_size": batch_size,
            "num_workers": 0,
        },
        "resamples": 200,
        "protocols": protocols,
    }
    path.write_text(yaml.safe_dump(suite))
    return path


# --- label subsets ---------------------------------------------------------------------------------------


def test_label_subset_is_class_balanced_seeded_and_nested():
    counts = {0: 50, 1: 7, 2: 1, 3: 120}
    labels = torch.tensor([c for c, n in counts.items() for _ in range(n)] + [-1] * 30)
    labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))]

    chosen = label_subset(labels, 0.1, seed=0)
    # round(0.1 x count) per class, at least one; never an unlabelled sample
    assert Counter(labels[chosen].tolist()) == {0: 5, 1: 1, 2: 1, 3: 12}
    assert chosen.tolist() == sorted(set(chosen.tolist()))
    assert torch.equal(label_subset(labels, 0.1, seed=0), chosen)  # the same seed, the same images
    assert not torch.equal(label_subset(labels, 0.1, seed=1), chosen)
    half = label_subset(labels, 0.5, seed=0)
    assert Counter(labels[half].tolist()) == {0: 25, 1: 4, 2: 1, 3: 60}  # round(3.5) = 4
    assert set(chosen.tolist()) <= set(half.tolist())  # one seed's subsets are nested
    assert torch.equal(label_subset(labels, 1.0, seed=3), torch.nonzero(labels >= 0).flatten())
    assert Counter(labels[label_subset(labels, 0.1, seed=0, classes=[1, 3])].tolist()) == {1: 1, 3: 12}


# --- mistakes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "protocol, words",
    [
        ({**LINEAR, "layer_decay": 0.7}, ["protocol 'linear' (linear_probe): unknown keys ['layer_decay']",
                                          "valid keys are name, kind"]),
        ({"name": "knn", "kind": "knn", "optimizer": "sgd"}, ["(knn): unknown keys ['optimizer']"]),
        ({**FINETUNE, "optimizer": "adam"}, ["optimizer is 'adam'", "'sgd', 'adamw' or 'lars'"]),
        ({**FINETUNE, "lrs": [-0.1]}, ["lrs[0] is -0.1", "greater than 0"]),
        ({**FINETUNE, "lrs": ["1e-3"]}, ["lrs[0] is '1e-3'", "write 1.0e-3"]),
        ({**FINETUNE, "epochs": "ten"}, ["epochs is 'ten'", "valid integer"]),
        ({**LINEAR, "lrs": [0.1, -1.0]}, ["lrs[1] is -1.0", "greater than 0"]),
        ({**LINEAR, "lrs": [0.1, 0.1]}, ["lrs [0.1, 0.1] repeat"]),
        ({**FINETUNE, "label_fractions": [0.1, 1.5]}, ["label_fractions[1] is 1.5", "or equal to 1"]),
        ({**FINETUNE, "momentum": 0.9}, ["momentum is for sgd and lars; adamw takes betas"]),
        ({**LINEAR, "optimizer": "lars", "betas": [0.9, 0.99]}, ["betas are adamw's; lars takes momentum"]),
        ({**FINETUNE, "steps": 5}, ["epochs and steps are both given"]),
        ({**FINETUNE, "augmentation": "strong"}, ["augmentation is 'strong'", "'supervised' or 'eval'"]),
        ({**FINETUNE, "mixup_alpha": 0.8}, ["mixup_alpha and cutmix_alpha belong to"]),
        ({**FINETUNE, "augmentation": "supervised", "randaugment": "strong"}, ["randaugment is 'strong'"]),
        ({**FINETUNE, "feature": "lastk"}, ["feature is 'lastk'", "'cls' or 'mean'"]),
        ({**LINEAR, "batch_norm": 1}, ["batch_norm is 1", "valid boolean"]),
        ({"name": "ft", "kind": "finetune", "steps": [5, 10]}, ["steps [5, 10] gives 2 numbers for 1"]),
    ],
    ids=["unknown-key", "key-of-another-kind", "optimizer", "negative-lr", "lr-as-text", "epochs-type",
         "lrs-item", "lrs-repeat", "fraction-range", "momentum-for-adamw", "betas-for-lars",
         "epochs-and-steps", "augmentation", "mixup-preset", "randaugment", "feature", "flag-type",
         "steps-per-fraction"],
)  # fmt: skip
def test_protocol_key_mistakes_are_one_line_and_write_nothing(protocol, words, digits_shards, tmp_path, cli):
    suite = write_suite(tmp_path / "suite.yaml", digits_shards, [protocol])
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"ssl-vit: error: {suite}: protocol ") and "Traceback" not in proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert not out.exists()


def test_compare_refuses_a_mistyped_protocol_key(digits_shards, tmp_path, cli):
    suite = write_suite(tmp_path / "suite.yaml", digits_shards, [{**FINETUNE, "weight_decay": -1.0}])
    out = tmp_path / "out"
    proc = cli("compare", "a=scratch", "--suite", str(suite), "--out", str(out), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "protocol 'ft': weight_decay is -1.0: input should be greater than or equal to 0" in proc.stderr
    assert not out.exists()


# --- the keys, run ---------------------------------------------------------------------------------------


def evaluate(cli, suite, out):
    cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out))
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def plain(digits_shards, tmp_path_factory):
    """A linear probe and a fine-tune written without any of the keys, evaluated once."""
    root = tmp_path_factory.mktemp("plain")
    suite = write_suite(root / "plain.yaml", digits_shards, [LINEAR, FINETUNE])
    return evaluate(run_cli, suite, root / "out")


@pytest.mark.slow
def test_results_json_records_every_key_and_the_recorded_protocol_reproduces_the_results(
    plain, digits_shards, tmp_path, cli
):
    linear, finetune = plain["protocols"]
    shared = {
        "dataset": "data", "feature": "cls", "classes": None, "epochs": 1, "steps": None, "batch_size": 64,
        "warmup_steps": 0, "decay": "cosine", "min_lr_ratio": 0.0, "augmentation": "pretrain",
        "crop_scale": [0.6, 1.0], "randaugment": None, "label_fractions": [1.0],
    }  # fmt: skip
    assert linear == {
        **LINEAR, **shared, "optimizer": "sgd", "momentum": 0.9, "betas": None, "weight_decay": 0.0,
        "batch_norm": True, "select_fraction": 0.1,
    }  # fmt: skip
    assert finetune == {
        **FINETUNE, **shared, "optimizer": "adamw", "momentum": None, "betas": [0.9, 0.999],
        "weight_decay": 0.05, "lrs": [1e-3], "layer_decay": None, "mixup_alpha": 0.0, "cutmix_alpha": 0.0,
        "label_smoothing": 0.0, "select_fraction": 0.1,
    }  # fmt: skip
    # Every key written out, at the recorded values: the same numbers as the suite without them.
    suite = write_suite(tmp_path / "explicit.yaml", digits_shards, plain["protocols"])
    explicit = evaluate(cli, suite, tmp_path / "out")
    assert explicit["protocols"] == plain["protocols"]
    assert explicit["results"] == plain["results"] and explicit["details"] == plain["details"]
    assert plain["details"]["ft"]["labels"] == 200 and plain["details"]["linear"]["fraction"] == 1.0


@pytest.mark.slow
def test_sgd_and_lars_suites_run_and_record_their_knobs(plain, digits_shards, tmp_path, cli):
    lars = {**LINEAR, "optimizer": "lars", "momentum": 0.8, "weight_decay": 1.0e-4, "warmup_steps": 2}
    sgd = {
        **FINETUNE, "epochs": None, "steps": 3, "optimizer": "sgd", "lrs": [0.05], "batch_size": 32,
        "decay": "linear", "min_lr_ratio": 0.1, "layer_decay": 0.75, "augmentation": "supervised",
        "randaugment": "rand-m9-mstd0.5", "label_smoothing": 0.1,
    }  # fmt: skip
    suite = write_suite(tmp_path / "suite.yaml", digits_shards, [lars, sgd])
    record = evaluate(cli, suite, tmp_path / "out")
    linear, finetune = record["protocols"]
    assert {k: linear[k] for k in lars} == lars and linear["betas"] is None
    assert {k: finetune[k] for k in sgd} == sgd and finetune["momentum"] == 0.9 and finetune["betas"] is None
    assert finetune["weight_decay"] == 0.05  # the fine-tune's default, kept with sgd
    assert finetune["layer_decay"] == 0.75 and finetune["crop_scale"] == [0.6, 1.0]
    assert record["details"]["ft"]["optimizer_steps"] == 3
    assert record["details"]["linear"]["optimizer_steps"] == plain["details"]["linear"]["optimizer_steps"]
    assert all(0 <= record["results"][c] <= 1 for c in ("linear", "ft"))
    # They trained otherwise than the defaults did: the same images, other losses.
    for column in ("linear", "ft"):
        assert record["details"][column]["train_loss"] != plain["details"][column]["train_loss"], column


# --- label fractions -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compare_with_label_fractions_writes_a_row_per_fraction_and_the_picture(digits_shards, tmp_path, cli):
    torch.manual_seed(0)
    model = SupervisedPretraining(ViTConfig(**BACKBONE), num_classes=10)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "sup.ckpt")
    protocols = [
        {**LINEAR, "label_fractions": [0.1, 1.0]},
        {**FINETUNE, "label_fractions": [0.02, 0.1]},
    ]
    suite = write_suite(tmp_path / "suite.yaml", digits_shards, protocols, "train-{000000..000004}.tar", 128)
    out = tmp_path / "out"
    proc = cli(
        "compare", f"sup={tmp_path / 'sup.ckpt'}", "--scratch", "--suite", str(suite), "--out", str(out)
    )
    assert "label_efficiency.png" in proc.stdout

    counts = json.loads((digits_shards / "train.json").read_text())["class_counts"].values()
    labels = {f: sum(max(1, round(f * n)) for n in counts) for f in (0.02, 0.1, 1.0)}
    assert labels == {0.02: 30, 0.1: 143, 1.0: 1438}
    columns = {"linear_10pct": 0.1, "linear": 1.0, "ft_2pct": 0.02, "ft_10pct": 0.1}
    rows = {row["name"]: row for row in csv.DictReader((out / "results.csv").open())}
    assert list(rows) == ["sup", "scratch"]
    for name, row in rows.items():
        record = json.loads((out / name / "results.json").read_text())
        assert list(record["results"]) == list(columns)
        for column, fraction in columns.items():
            assert float(row[f"{column}_low"]) <= float(row[column]) <= float(row[f"{column}_high"])
            assert float(row[column]) == pytest.approx(record["results"][column])
            detail = record["details"][column]
            assert (detail["fraction"], detail["labels"]) == (fraction, labels[fraction])
            # an epoch of a subset is its training images in whole batches, at least one (the linear
            # probe chooses its lr on a tenth of the labels, held out of its training images)
            assert detail["optimizer_steps"] == max(1, detail["training_images"] // 128), column
            held = detail.get("selection_images", 0)
            assert detail["training_images"] + held == labels[fraction]
            assert (held > 0) == column.startswith("linear")

    efficiency = list(csv.DictReader((out / "label_efficiency.csv").open()))
    assert [(r["name"], r["protocol"], float(r["fraction"]), int(r["labels"])) for r in efficiency] == [
        (name, protocol, fraction, labels[fraction])
        for name in ("sup", "scratch")
        for protocol, fractions in (("linear", (0.1, 1.0)), ("ft", (0.02, 0.1)))
        for fraction in fractions
    ]
    for r in efficiency:
        column = next(
            c for c, f in columns.items() if c.startswith(r["protocol"]) and f == float(r["fraction"])
        )
        assert r["metric"] == "accuracy" and float(r["value"]) == pytest.approx(
            float(rows[r["name"]][column])
        )
    with Image.open(out / "label_efficiency.png") as picture:
        assert picture.format == "PNG" and picture.size == (1100, 440)  # two panels


@pytest.mark.slow
def test_steps_may_differ_per_label_fraction_and_every_column_records_its_loss_curve(
    digits_shards, tmp_path, cli
):
    """`steps: [3, 5]` with `label_fractions: [0.1, 0.5]`: the 10% column trains 3 steps, the 50% one 5,
    each recording its training loss at every step (fewer steps than the curve's points)."""
    ft = {"name": "ft", "kind": "finetune", "steps": [3, 5], "label_fractions": [0.1, 0.5], "batch_size": 16}
    record = evaluate(cli, write_suite(tmp_path / "suite.yaml", digits_shards, [ft]), tmp_path / "out")
    for column, steps in (("ft_10pct", 3), ("ft_50pct", 5)):
        detail = record["details"][column]
        assert detail["optimizer_steps"] == steps
        assert [step for step, _ in detail["loss_curve"]] == list(range(1, steps + 1))
        assert detail["loss_curve"][-1][1] == pytest.approx(detail["train_loss"], rel=1e-4)
