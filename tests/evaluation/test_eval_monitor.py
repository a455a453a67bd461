"""FewShotMonitor: logs few-shot accuracy during a real (tiny) fit, builds from a LightningCLI config, and
every pretraining recipe runs it."""

import csv
import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import yaml
from cli_helpers import run_cli
from pytorch_lightning.loggers import CSVLogger

from ssl_vit.cli import main
from ssl_vit.data import ShardDataModule
from ssl_vit.errors import UserError
from ssl_vit.evaluation.features import extract_features
from ssl_vit.evaluation.fewshot import fewshot_accuracy
from ssl_vit.evaluation.monitor import FewShotMonitor
from ssl_vit.models.vit import build_vit


class TinyClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = build_vit("S/8", 32, width=32, depth=1, heads=2)
        self.head = torch.nn.Linear(32, 10)
        self.modes: list[bool] = []  # backbone.training at every step

    def training_step(self, batch, batch_idx):
        self.modes.append(self.backbone.training)
        return F.cross_entropy(self.head(self.backbone.forward_tokens(batch["image"]).pooled), batch["label"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_monitor_logs_fewshot_during_fit(digits_shards, tmp_path):
    # the labelled set: digits val split in two, 2 shards (200 samples) for support, 2 for test
    support = [str(digits_shards / f"val-00000{i}.tar") for i in (0, 1)]
    test = [str(digits_shards / f"val-00000{i}.tar") for i in (2, 3)]
    monitor = FewShotMonitor(support, test, every_n_steps=2, shots=(1, 5), seeds=(0, 1), batch_size=100)
    data = ShardDataModule(
        train_urls=str(digits_shards / "train-{000000..000004}.tar"),
        batch_size=8,
        num_workers=0,
        image_size=32,
        train_batches=6,
    )
    torch.manual_seed(0)
    model = TinyClassifier()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        accumulate_grad_batches=2,  # 6 batches; global steps 0, 0, 1, 1, 2, 2 at their starts
        callbacks=[monitor],
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)

    assert model.modes == [True] * 6  # train mode restored after the evaluation at step 2
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("fewshot/5shot")]
    # not at step 0, once at step 2 although two batches start there, and at the end of training
    assert [int(r["step"]) for r in rows] == [2, 3]
    # the last row is the protocol on the final weights
    train, held = (
        extract_features(model.backbone, dm.exact_dataloader("val"), prepare=dm.prepare_batch)
        for dm in (ShardDataModule(val_urls=urls, image_size=32, num_workers=0) for urls in (support, test))
    )
    expected = fewshot_accuracy(train.x, train.y, held.x, held.y, shots=(1, 5), seeds=(0, 1))
    for shots in (1, 5):
        assert abs(float(rows[-1][f"fewshot/{shots}shot"]) - expected[shots][0]) < 1e-6


def test_monitor_skips_fast_dev_runs(digits_shards, tmp_path):
    """fast_dev_run's loggers are a dummy: an evaluation would only cost time."""
    monitor = FewShotMonitor(every_n_steps=1)
    data = ShardDataModule(train_urls=str(digits_shards / "train-000000.tar"),
                           val_urls=str(digits_shards / "val-000000.tar"),
                           num_workers=0, image_size=32)  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", fast_dev_run=2, callbacks=[monitor], default_root_dir=tmp_path)
    trainer.fit(TinyClassifier(), data)
    assert trainer.global_step == 2 and monitor._last_step is None


def test_monitor_builds_from_a_cli_config():
    """LightningCLI instantiates callbacks through jsonargparse from the constructor's type hints."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[pl.Callback])
    config = {
        "class_path": "ssl_vit.evaluation.monitor.FewShotMonitor",
        "init_args": {"train_urls": "a.tar", "test_urls": ["b.tar"], "every_n_steps": 5, "shots": [1, 10],
                      "feature": "lastk", "classes": [5, 6]},
    }  # fmt: skip
    (monitor,) = parser.instantiate_classes(
        parser.parse_args(["--callbacks", json.dumps([config])])
    ).callbacks
    assert isinstance(monitor, FewShotMonitor)
    assert (monitor.every_n_steps, monitor.shots, monitor.feature, monitor.classes) == (
        5,
        (1, 10),
        "lastk",
        [5, 6],
    )


ROOT = Path(__file__).resolve().parents[2]
PRETRAINING = sorted(
    p
    for p in (ROOT / "recipes").rglob("*.yaml")
    if p.read_text().startswith("# ssl-vit fit") and "Pretraining" in p.read_text()
)


def test_there_are_pretraining_recipes_to_check():
    names = {p.relative_to(ROOT / "recipes").as_posix() for p in PRETRAINING}
    assert {"quickstart/mpp.yaml", "quickstart/supervised.yaml", "mae/b16_in1k.yaml", "mae/h14_in1k.yaml",
            "simmim/b16_in1k.yaml", "vit_paper/mpp_b16.yaml",
            "vit_paper/supervised_b16_in21k.yaml"} <= names  # fmt: skip


@pytest.mark.parametrize("recipe", PRETRAINING, ids=lambda p: p.relative_to(ROOT / "recipes").as_posix())
def test_every_pretraining_recipe_monitors_fewshot_and_states_its_cost(recipe, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(recipe), "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    (monitor,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith(".FewShotMonitor")]
    assert monitor["init_args"]["every_n_steps"] > 0 and monitor["init_args"]["shots"]
    # the file that configures it says what it costs
    trainer_file = recipe.parent / yaml.safe_load(recipe.read_text())["trainer"]
    assert "Cost" in trainer_file.read_text()


@pytest.mark.slow
def test_a_tiny_quickstart_fit_logs_fewshot(digits_shards, tmp_path):
    """The quickstart MPP recipe through the CLI, three steps: the monitor follows the data's own URLs
    and logs fewshot/Nshot at step 2 and at the end."""
    logs = tmp_path / "logs"
    run_cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        "--data.init_args.train_urls", str(digits_shards / "train-{000000..000004}.tar"),
        "--data.init_args.val_urls", str(digits_shards / "val-{000000..000003}.tar"),
        "--data.init_args.num_workers", "0",
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
        "--trainer.callbacks.init_args.every_n_steps", "2",
        "--trainer.logger", json.dumps({"class_path": "pytorch_lightning.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(logs)}}),
        "--trainer.default_root_dir", str(tmp_path / "run"),
        cwd=ROOT,
    )  # fmt: skip
    with open(logs / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("fewshot/10shot")]
    assert [int(r["step"]) for r in rows] == [2, 3]
    assert all(0.0 <= float(r[f"fewshot/{k}shot"]) <= 1.0 for r in rows for k in (1, 5, 10))


def test_a_monitor_without_a_labelled_set_is_one_line(digits_shards, tmp_path):
    """No URLs of its own and data without val_urls: the fit stops at start-up, naming the fix."""
    monitor = FewShotMonitor()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, callbacks=[monitor], logger=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    data = ShardDataModule(train_urls=str(digits_shards / "train-000000.tar"), num_workers=0, image_size=32)
    with pytest.raises(UserError, match=r"^FewShotMonitor has no labelled set: give its train_urls") as err:
        trainer.fit(TinyClassifier(), data)
    assert "\n" not in str(err.value)


def test_logged_throughput_leaves_out_validation_and_the_monitor(digits_shards, tmp_path, monkeypatch):
    """`perf/images_per_s` is training's own rate: the clock stops for validation and for the few-shot
    monitor's evaluations. A fake clock makes every training batch take 1 s and every validation
    batch and evaluation 100 s, so each logged rate is exactly the batch size."""
    from ssl_vit.models.vit import ViTConfig
    from ssl_vit.tasks import SupervisedPretraining
    from ssl_vit.tasks.base import Throughput

    now = [0.0]

    class Tick(pl.Callback):
        def on_train_batch_end(self, *args):
            now[0] += 1.0

        def on_validation_batch_end(self, *args):
            now[0] += 100.0

    evaluate = FewShotMonitor._evaluate

    def slow_evaluate(self, trainer, pl_module):
        now[0] += 100.0
        evaluate(self, trainer, pl_module)

    monkeypatch.setattr(FewShotMonitor, "_evaluate", slow_evaluate)
    throughput = Throughput()
    throughput.clock = lambda: now[0]
    val = str(digits_shards / "val-000000.tar")
    monitor = FewShotMonitor(val, val, every_n_steps=2, shots=(1,), seeds=(0,), batch_size=100)
    data = ShardDataModule(
        train_urls=str(digits_shards / "train-{000000..000004}.tar"),
        val_urls=val,
        batch_size=8,
        num_workers=0,
        image_size=32,
        train_batches=6,
    )
    torch.manual_seed(0)
    model = SupervisedPretraining(ViTConfig("S/8", 32, width=32, depth=1, heads=2), num_classes=10)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        log_every_n_steps=1,
        callbacks=[Tick(), monitor, throughput],
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)

    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    rates = [float(r["perf/images_per_s"]) for r in rows if r.get("perf/images_per_s")]
    assert sum(1 for r in rows if r.get("val/loss")) == 3  # validation after steps 2, 4 and 6
    assert sum(1 for r in rows if r.get("fewshot/1shot")) == 3  # the monitor at steps 2, 4 and the end
    assert now[0] == 6 + 3 * 200 + 3 * 100 + 100  # sanity check's batch included: the clock did move
    assert rates == [8.0] * 6
