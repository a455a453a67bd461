"""Every adapter builds its peer's model, takes one training step at a tiny size, and a checkpoint the
peer saved reads back through ssl-vit's loader as the same backbone (`ssl_vit.checkpoints.peers`).
Run by `make peers` in .venv-peers, where the peers are installed; a skip there is a failure
(conftest.py)."""

import subprocess
import sys
from dataclasses import replace

import adapter_lightly
import adapter_stable_pretraining
import lightning
import pytest
import torch
from common import Settings, one_step, sslvit
from speed import optimizer

from ssl_vit.checkpoints import load_backbone
from ssl_vit.models.vit import ViTConfig

TINY = Settings("Ti/16", 32, decoder_dim=32, decoder_depth=1, decoder_heads=4)
# lightly's I-JEPA collator, as the paper's, draws a target block (15-20% of the patches) again until it
# holds more than 10 tokens: 10 x 10 patches at least.
SIZES = {"ijepa": replace(TINY, img_size=160)}
ADAPTERS = {a.PEER: a for a in (adapter_lightly, adapter_stable_pretraining)}
CASES = [(peer, method) for peer, adapter in ADAPTERS.items() for method in adapter.METHODS]


def step_changes_the_model(impl, settings: Settings = TINY) -> float:
    torch.manual_seed(0)
    images = torch.randn(2, 3, settings.img_size, settings.img_size)
    before = {k: v.clone() for k, v in impl.model.state_dict().items()}
    loss = one_step(impl, optimizer(impl), images)
    assert torch.isfinite(loss), loss
    changed = [k for k, v in impl.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "one AdamW step changed no tensor"
    return float(loss)


@pytest.mark.parametrize("peer, method", CASES)
def test_the_peer_takes_one_step(peer, method):
    settings = SIZES.get(method, TINY)
    loss = step_changes_the_model(ADAPTERS[peer].build(method, settings), settings)
    print(f"{peer} {method}: loss {loss:.4f}")


@pytest.mark.parametrize("method", sorted({method for _, method in CASES}))
def test_ssl_vit_takes_the_same_step(method):
    settings = SIZES.get(method, TINY)
    step_changes_the_model(sslvit(method, settings), settings)


class SptLightning(lightning.LightningModule):
    """stable-pretraining's MAE under Lightning, as its docstring's example trains it."""

    def __init__(self):
        super().__init__()
        self.model = adapter_stable_pretraining.build_mae(TINY)

    def training_step(self, batch, batch_idx):
        return self.model(batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1.5e-4)


def saved_by_lightly(tmp_path):
    model = adapter_lightly.MAE(TINY)
    step_changes_the_model(adapter_lightly.build("mae", TINY)._replace(model=model, loss=model))
    path = tmp_path / "lightly_mae.pth"
    torch.save(model.state_dict(), path)
    return path, lambda images: model.backbone.encode(images)


def saved_by_stable_pretraining(tmp_path):
    module = SptLightning()
    trainer = lightning.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    images = torch.randn(4, 3, TINY.img_size, TINY.img_size)
    trainer.fit(module, torch.utils.data.DataLoader(images, batch_size=2))
    path = tmp_path / "spt_mae.ckpt"
    trainer.save_checkpoint(path)
    module.model.eval()  # no masking: every token encoded
    return path, lambda images: module.model.encoder(images).encoded


@pytest.mark.parametrize("saved_by", [saved_by_lightly, saved_by_stable_pretraining])
def test_a_checkpoint_the_peer_saved_loads_as_its_backbone(tmp_path, saved_by):
    path, encode = saved_by(tmp_path)
    vit, config = load_backbone(str(path), ViTConfig(TINY.variant, TINY.img_size))
    images = torch.randn(2, 3, TINY.img_size, TINY.img_size)
    with torch.no_grad():
        theirs, ours = encode(images), vit.eval().forward_features(images)
    torch.testing.assert_close(ours, theirs)
    info = subprocess.run(
        [sys.executable, "-m", "ssl_vit", "info", str(path)], capture_output=True, text=True, timeout=300
    )
    assert info.returncode == 0, info.stderr
    assert "MAE (its ViT read by" in info.stdout and "Ti/16" in info.stdout, info.stdout


def test_quality_trains_each_peer_on_the_study_recipe_and_exports_a_loadable_encoder(tmp_path, capsys):
    """quality.py's training and export, 2 steps of each peer's MAE and SimMIM on shards written here;
    its comparison runs `ssl-vit compare` on the study's suite less fine-tuning (`quick_suite`)."""
    import json

    import numpy as np
    import quality
    import yaml
    from PIL import Image

    folder = tmp_path / "images"
    rng = np.random.default_rng(0)
    for label in range(2):
        (folder / str(label)).mkdir(parents=True)
        for i in range(40):
            image = rng.integers(0, 256, (28, 28), dtype=np.uint8)
            Image.fromarray(image).save(folder / str(label) / f"{i}.png")
    shards = tmp_path / "shards"
    convert = [sys.executable, "-m", "ssl_vit", "data", "convert", f"imagefolder:{folder}", str(shards)]
    assert subprocess.run([*convert, "--no-progress"], capture_output=True, timeout=300).returncode == 0
    out = tmp_path / "quality"
    train = ["--seeds", "0", "--steps", "2", "--train-urls", str(shards / "train-000000.tar"), "--no-compare"]
    assert quality.main([*train, "--out", str(out)]) == 0
    for peer in ADAPTERS:
        for method in ("mae", "simmim"):
            run = out / f"{peer}_{method}_0"
            # 80 images make one batch of 64 an epoch: the second step is the second epoch's
            assert list(json.loads((run / "train.json").read_text())["loss"]) == ["0", "1"]
            recipe = quality.study_recipe(method)["settings"]
            vit, _ = load_backbone(str(run / "encoder.safetensors"), recipe.config())
            assert vit.embed_dim == 96 and len(vit.blocks) == 6
    # ssl-vit's seeds from `--study`, the peers' from `--peer-seeds`: their runs reused or trained, and
    # nothing compared while one of ssl-vit's is missing (named)
    capsys.readouterr()
    some = [*train[:-1], "--peers", "adapter_stable_pretraining", "--methods", "simmim", "--out", str(out)]
    assert quality.main([*some, "--study", str(tmp_path / "none"), "--peer-seeds", "0", "1"]) == 1
    assert (out / "stable-pretraining_simmim_1/train.json").exists()
    (missing,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("not compared")]
    assert "none/simmim_0/" in missing and "simmim_1" not in missing and "stable-pretraining" not in missing
    written = quality.quick_suite(quality.STUDY / "eval.yaml", tmp_path / "suite.yaml")
    suite = yaml.safe_load(written.read_text())
    kinds = {p["kind"] for p in suite["protocols"]}
    assert "finetune" not in kinds and {"fewshot", "knn", "linear_probe", "attentive_probe"} <= kinds


def test_every_feed_gives_batches_and_says_whether_it_resumes_exactly(tmp_path):
    """feed.py at a tiny size: 120 JPEGs, batches of 8 on 2 workers. Every feed gives (images, labels,
    keys) batches of the crop's size; ssl-vit resumes mid-epoch to the same keys and pixels, litdata and
    mosaicml-streaming to the same samples (their workers' augmentation draws are not in their state),
    webdataset keeps no state."""
    import feed

    samples = feed.write_jpegs(tmp_path / "jpg", 120)
    assert len(samples) == 120 and [label for _, label in samples] == sorted(label for _, label in samples)
    for name, make in feed.FEEDS.items():
        batches_of, _ = make(samples, tmp_path, 2, 8)
        result = feed.measure(batches_of, 2, len(feed.PHOTOS))
        del batches_of
        assert result["img_s"] > 0 and 0 < result["mix"] <= 1.5, (name, result)
    resumes = {name: feed.resumes_exactly(make, samples, tmp_path, 2, 8) for name, make in feed.FEEDS.items()}
    assert resumes == {
        "ssl-vit": "yes",
        "webdataset": "no: no state to save",
        "litdata": "order only: other augmentations",
        "mosaicml-streaming": "order only: other augmentations",
    }


@pytest.mark.parametrize("method", ["mae", "simmim"])
def test_from_the_same_weights_and_mask_ssl_vit_computes_the_peers_loss_and_gradients(method):
    """What makes the quality comparison's remaining gaps seed noise, not a defect (RESULTS.md): ssl-vit's
    MAE on lightly's target and start is lightly's MAE, its SimMIM on stable-pretraining's target is
    stable-pretraining's SimMIM, to float rounding."""
    import equivalence

    result = equivalence.compare(method)
    assert result["ours"] == pytest.approx(result["theirs"], rel=1e-6), result
    assert result["grad_rel_diff"] < 1e-5 and result["tensors"] >= 10, result
