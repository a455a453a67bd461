"""Evaluation on images of other band counts: a suite's `channels`, `mean` and `std` (`auto` too) reach
the data modules it builds, the backbone reads its `channels` (scratch built so, RGB checkpoints adapted,
saying so, others refused), and every protocol kind and the few-shot monitor run on five-band shards."""

import json

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.loggers import CSVLogger

from ssl_vit.checkpoints import load_backbone
from ssl_vit.data import ShardDataModule
from ssl_vit.errors import UserError
from ssl_vit.evaluation.monitor import FewShotMonitor
from ssl_vit.evaluation.suite import evaluate, load_suite
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining, SupervisedPretraining
from ssl_vit.tasks.base import Training

BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}
# The masks' normalisation given by hand; the labelled shards' is `auto` (their manifest's).
MEAN, STD = [100.0, 1100.0, 2100.0, 3100.0, 4100.0], [300.0, 300.0, 300.0, 300.0, 300.0]
PROTOCOLS = [
    {"name": "fewshot", "kind": "fewshot", "feature": "mean", "shots": [1, 5], "seeds": [0]},
    {"name": "knn", "kind": "knn", "feature": "mean", "k": 5},
    {"name": "linear", "kind": "linear_probe", "feature": "mean", "epochs": 1, "lrs": [0.1]},
    {"name": "attentive", "kind": "attentive_probe", "epochs": 1, "lrs": [1.0e-3], "weight_decays": [0.0],
     "batch_size": 16},
    {"name": "ft", "kind": "finetune", "feature": "mean", "steps": 2, "lrs": [1.0e-3], "batch_size": 16},
    {"name": "seg", "kind": "linear_seg", "dataset": "masks", "epochs": 1, "lrs": [0.1], "batch_size": 20},
]  # fmt: skip


def bands_suite(path, band_shards, band_masks, protocols=PROTOCOLS):
    suite = {
        "backbone": BACKBONE,
        "datasets": {
            "bands": {"train_urls": str(band_shards / "train-{000000..000001}.tar"),
                      "test_urls": str(band_shards / "val-000000.tar"), "image_size": 32, "batch_size": 16,
                      "num_workers": 0, "channels": 5, "mean": "auto", "std": "auto"},
            "masks": {"train_urls": str(band_masks / "train-{000000..000001}.tar"),
                      "test_urls": str(band_masks / "test-000000.tar"), "image_size": 32, "batch_size": 20,
                      "num_workers": 0, "channels": 5, "mean": MEAN, "std": STD},
        },
        "resamples": 100,
        "protocols": protocols,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(suite))
    return path


def saved(task, path) -> str:
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(task)
    trainer.save_checkpoint(path)
    return str(path)


@pytest.mark.slow
def test_every_protocol_kind_runs_on_five_bands_from_an_adapted_rgb_checkpoint(
    band_shards, band_masks, tmp_path, monkeypatch, capsys
):
    torch.manual_seed(0)
    rgb = saved(SupervisedPretraining(ViTConfig(**BACKBONE), num_classes=4), tmp_path / "rgb.ckpt")
    suite = load_suite(bands_suite(tmp_path / "suite.yaml", band_shards, band_masks))
    assert suite.backbone.in_chans == 5
    seen = []  # the data modules the suite builds, as each prepares a batch
    prepare = ShardDataModule.prepare_batch
    monkeypatch.setattr(
        ShardDataModule, "prepare_batch", lambda self, b: seen.append(self) or prepare(self, b)
    )
    record = evaluate(rgb, suite).record
    note = f"adapted the patch embedding of {rgb} from 3 to 5 input bands (timm's adapt_input_conv)"
    assert capsys.readouterr().err.count(f"ssl-vit: note: {note}\n") == 1
    assert record["backbone"]["in_chans"] == 5
    assert set(record["results"]) == {
        "fewshot_1shot", "fewshot_5shot", "knn", "linear", "attentive", "ft", "seg_miou", "seg_pixel_acc",
    }  # fmt: skip
    assert all(0 <= value <= 1 for value in record["results"].values()), record["results"]
    assert record["results"]["knn"] > 0.9, record["results"]  # the classes are 300 units apart in every band
    stats = json.loads((band_shards / "train.json").read_text())["band_stats"]
    # every split of a dataset normalised alike: 'auto' is the training split's statistics, the test
    # split's manifest has its own
    means = {tuple(round(m) for m in dm.mean) for dm in seen}
    assert {dm.channels for dm in seen} == {5} and len(seen) > 10
    assert means == {tuple(round(m) for m in stats["mean"]), tuple(round(m) for m in MEAN)}


def test_a_suites_channels_build_scratch_and_decide_what_loads(band_shards, band_masks, tmp_path):
    suite = load_suite(bands_suite(tmp_path / "suite.yaml", band_shards, band_masks, PROTOCOLS[:1]))
    vit, config = load_backbone("scratch", suite.backbone)
    assert vit.in_chans == config.in_chans == 5
    rgb = saved(SupervisedPretraining(ViTConfig(**BACKBONE), num_classes=4), tmp_path / "rgb.ckpt")
    assert load_backbone(rgb, suite.backbone)[0].in_chans == 5
    four = SupervisedPretraining(
        ViTConfig(**BACKBONE, in_chans=4), num_classes=4, training=Training(mean=MEAN[:4], std=STD[:4])
    )
    with pytest.raises(UserError, match="holds weights for 4 input bands and the backbone reads 5"):
        load_backbone(saved(four, tmp_path / "four.ckpt"), suite.backbone)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"masks": {"channels": 3}}, "the datasets have different band counts (bands 5, masks 3)"),
        ({"bands": {"channels": 0}}, "bands: channels is 0: it should be an integer of at least 1"),
        ({"backbone": {"in_chans": 3}}, "backbone in_chans 3 and the data's channels 5 differ"),
    ],
)
def test_band_mistakes_in_a_suite_are_one_line(change, words, band_shards, band_masks, tmp_path):
    path = bands_suite(tmp_path / "suite.yaml", band_shards, band_masks, PROTOCOLS[:1])
    raw = yaml.safe_load(path.read_text())
    for key, values in change.items():
        (raw["datasets"][key] if key in raw["datasets"] else raw[key]).update(values)
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError) as error:
        load_suite(path)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_the_fewshot_monitor_reads_the_training_datas_bands(band_shards, tmp_path):
    train, val = str(band_shards / "train-{000000..000001}.tar"), str(band_shards / "val-000000.tar")
    monitor = FewShotMonitor(
        train, val, every_n_steps=1, shots=(1, 5), seeds=(0,), batch_size=16, feature="mean"
    )
    bands = dict(channels=5, mean="auto", std="auto")
    data = ShardDataModule(
        train_urls=train, batch_size=8, num_workers=0, image_size=32, train_batches=2, **bands
    )
    torch.manual_seed(0)
    model = MaskedPatchPretraining(
        ViTConfig(**BACKBONE, in_chans=5), preset="mae", training=Training(mean=data.mean, std=data.std),
        decoder_dim=32, decoder_depth=1, decoder_heads=2, picture_every_n_steps=0,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[monitor], logger=CSVLogger(tmp_path), limit_val_batches=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert monitor.datamodule.channels == 5 and monitor.datamodule.mean == data.mean
    rows = (tmp_path / "lightning_logs/version_0/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    scores = [dict(zip(header, row.split(","))) for row in rows[1:]]
    logged = [float(row["fewshot/5shot"]) for row in scores if row.get("fewshot/5shot")]
    assert len(logged) == 2 and all(0 < value <= 1 for value in logged), json.dumps(scores)
