"""Evaluation on images of other band counts: a suite's `channels`, `mean` and `std` reach the data modules
it builds, the backbone reads its `channels` (scratch built so, RGB checkpoints adapted, saying so), every
protocol kind and the few-shot monitor run on five bands (the stand-in data module of `bands_standin`
repeats the digits' RGB bands, until the data module reads N-band shards itself)."""

import json

import pytest
import pytorch_lightning as pl
import test_eval_linear_seg
import torch
import yaml
from bands_standin import install
from pytorch_lightning.loggers import CSVLogger

from ssl_vit.checkpoints import load_backbone
from ssl_vit.data import ShardDataModule
from ssl_vit.errors import UserError
from ssl_vit.evaluation.monitor import FewShotMonitor
from ssl_vit.evaluation.suite import evaluate, load_suite
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining, SupervisedPretraining

mask_shards = test_eval_linear_seg.mosaics  # the fixture: mosaics with segmentation masks, here too
BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}
MEAN, STD = [0.1, 0.2, 0.3, 0.4, 0.5], [0.2, 0.25, 0.3, 0.35, 0.4]
PROTOCOLS = [
    {"name": "fewshot", "kind": "fewshot", "feature": "mean", "shots": [1, 5], "seeds": [0]},
    {"name": "knn", "kind": "knn", "feature": "mean", "k": 5},
    {"name": "linear", "kind": "linear_probe", "feature": "mean", "epochs": 1, "lrs": [0.1]},
    {"name": "attentive", "kind": "attentive_probe", "epochs": 1, "lrs": [1.0e-3], "weight_decays": [0.0],
     "batch_size": 50},
    {"name": "ft", "kind": "finetune", "feature": "mean", "steps": 2, "lrs": [1.0e-3], "batch_size": 32},
    {"name": "seg", "kind": "linear_seg", "dataset": "mosaics", "epochs": 1, "lrs": [0.1], "batch_size": 20},
]  # fmt: skip


def bands_suite(path, digits_shards, mask_shards, channels=5, **data):
    bands = {"channels": channels, "mean": MEAN[:channels], "std": STD[:channels], **data}
    suite = {
        "backbone": BACKBONE,
        "datasets": {
            "digits": {"train_urls": str(digits_shards / "val-{000000..000001}.tar"),
                       "test_urls": str(digits_shards / "val-000002.tar"), "image_size": 32,
                       "batch_size": 100, "num_workers": 0, **bands},
            "mosaics": {"train_urls": str(mask_shards / "train-{000000..000001}.tar"),
                        "test_urls": str(mask_shards / "test-000000.tar"), "image_size": 32, "batch_size": 20,
                        "num_workers": 0, **bands},
        },
        "resamples": 100,
        "protocols": PROTOCOLS,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(suite))
    return path


@pytest.fixture
def rgb_ckpt(tmp_path):
    torch.manual_seed(0)
    task = SupervisedPretraining(ViTConfig(**BACKBONE), num_classes=10)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(task)
    trainer.save_checkpoint(tmp_path / "rgb.ckpt")
    return str(tmp_path / "rgb.ckpt")


@pytest.mark.slow
def test_every_protocol_kind_runs_on_five_bands_from_an_adapted_rgb_checkpoint(
    digits_shards,
    mask_shards,
    rgb_ckpt,
    tmp_path,
    monkeypatch,
    capsys,
):
    install(monkeypatch)
    suite = load_suite(bands_suite(tmp_path / "suite.yaml", digits_shards, mask_shards))
    assert suite.backbone.in_chans == 5
    record = evaluate(rgb_ckpt, suite).record
    assert (
        capsys.readouterr().err.count(
            f"ssl-vit: note: adapted the patch embedding of {rgb_ckpt} from 3 to 5 input bands (timm's "
            "adapt_input_conv)"
        )
        == 1
    )
    assert record["backbone"]["in_chans"] == 5
    assert set(record["results"]) == {
        "fewshot_1shot", "fewshot_5shot", "knn", "linear", "attentive", "ft", "seg_miou", "seg_pixel_acc",
    }  # fmt: skip
    assert all(0 <= value <= 1 for value in record["results"].values()), record["results"]
    # the data modules the suite built read the five bands with the suite's normalisation
    seen = []
    original = ShardDataModule.prepare_batch
    monkeypatch.setattr(
        ShardDataModule, "prepare_batch", lambda self, b: seen.append(self) or original(self, b)
    )
    evaluate("scratch", load_suite(bands_suite(tmp_path / "knn.yaml", digits_shards, mask_shards)))
    assert seen and all(dm.channels == 5 and list(dm.mean) == MEAN and list(dm.std) == STD for dm in seen)


def test_a_suites_channels_build_scratch_and_decide_what_loads(
    digits_shards, mask_shards, rgb_ckpt, tmp_path, monkeypatch
):
    install(monkeypatch)
    suite = load_suite(bands_suite(tmp_path / "suite.yaml", digits_shards, mask_shards, channels=4))
    vit, config = load_backbone("scratch", suite.backbone)
    assert vit.in_chans == config.in_chans == 4
    assert load_backbone(rgb_ckpt, suite.backbone)[1].in_chans == 4
    five = tmp_path / "five.ckpt"
    task = SupervisedPretraining(ViTConfig(**BACKBONE, in_chans=5), num_classes=10, mean=MEAN, std=STD)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(task)
    trainer.save_checkpoint(five)
    with pytest.raises(UserError, match="holds weights for 5 input bands and the backbone reads 4"):
        load_backbone(str(five), suite.backbone)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"mosaics": {"channels": 3}}, "the datasets have different band counts (digits 5, mosaics 3)"),
        ({"digits": {"channels": 0}}, "digits.channels is 0: give the number of bands, a positive integer"),
        ({"backbone": {"in_chans": 3}}, "backbone in_chans 3 and the data's channels 5 differ"),
    ],
)
def test_band_mistakes_in_a_suite_are_one_line(
    change, words, digits_shards, mask_shards, tmp_path, monkeypatch
):
    install(monkeypatch)
    path = bands_suite(tmp_path / "suite.yaml", digits_shards, mask_shards)
    raw = yaml.safe_load(path.read_text())
    for key, values in change.items():
        (raw["datasets"][key] if key in raw["datasets"] else raw[key]).update(values)
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError) as error:
        load_suite(path)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_the_fewshot_monitor_reads_the_training_datas_bands(digits_shards, tmp_path, monkeypatch):
    install(monkeypatch)
    support, test = (
        [str(digits_shards / f"val-00000{i}.tar") for i in (0, 1)],
        str(digits_shards / "val-000002.tar"),
    )
    monitor = FewShotMonitor(
        support, test, every_n_steps=1, shots=(1, 5), seeds=(0,), batch_size=100, feature="mean"
    )
    data = ShardDataModule(
        train_urls=str(digits_shards / "train-000000.tar"), batch_size=8, num_workers=0, image_size=32,
        train_batches=2, channels=5, mean=MEAN, std=STD,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MaskedPatchPretraining(
        ViTConfig(**BACKBONE, in_chans=5), preset="mae", mean=MEAN, std=STD, decoder_dim=32, decoder_depth=1,
        decoder_heads=2, picture_every_n_steps=0,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[monitor], logger=CSVLogger(tmp_path), limit_val_batches=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert monitor.datamodule.channels == 5 and list(monitor.datamodule.mean) == MEAN
    rows = (tmp_path / "lightning_logs/version_0/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    scores = [dict(zip(header, row.split(","))) for row in rows[1:]]
    logged = [float(row["fewshot/5shot"]) for row in scores if row.get("fewshot/5shot")]
    assert len(logged) == 2 and all(0 < value <= 1 for value in logged), json.dumps(scores)
