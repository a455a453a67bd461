"""`ssl-vit analyze`: the ViT paper's look inside a checkpoint (sec 4.5, Figure 7), on any checkpoint.

Writes into OUT:
- attention_distance.png: mean attention distance of every head against block depth (Figure 7 right),
- position_embeddings.png: cosine similarity of each position embedding with all others (Figure 7 centre),
- patch_embedding_pcs.png: leading principal components of the patch-embedding filters (Figure 7 left),
- attention_rollout.png: attention rollout of the pooled output over a few images (Abnar & Zuidema 2020),
- masked_predictions.png: for masked-pretraining checkpoints, inputs beside their predicted mean colours
  or reconstructed pixels, under a fixed mask,
- analysis.json: the numbers drawn.

Images of other than 3 bands (multispectral checkpoints) are drawn in false colour from three display
bands (`--display-bands`; by default a masked-pretraining checkpoint's own `display_bands`, else the first
three), each stretched between its 2nd and 98th percentile (`ssl_vit.targets.masked_picture.false_colour`);
the filter components are computed over all bands and drawn in those three (`embeddings`).

Everything is computed first; analysis.json is written into a temporary directory next to OUT and
renamed into place, then the pictures are drawn into it, each of which may fail without costing the
numbers (one warning line, and a note in analysis.json: `ssl_vit.storage.outdir`).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from ssl_vit.analysis import attention, embeddings, pictures
from ssl_vit.analysis.images import read_images
from ssl_vit.checkpoints.load import load_backbone, mapped_checkpoint
from ssl_vit.data import ShardDataModule
from ssl_vit.data.stream.urls import shard_directories
from ssl_vit.errors import UserError
from ssl_vit.internals import CLASS_PATH_KEY
from ssl_vit.models.vit import ViTConfig
from ssl_vit.storage.outdir import Input, Output, checkpoint_inputs
from ssl_vit.targets.masked_picture import false_colour, masked_prediction_picture
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.base import Training, upgraded_hparams
from ssl_vit.tasks.masked import check_display_bands

ROLLOUT_IMAGES = 8  # images in the rollout and masked-prediction pictures
MASK_SEED = 0  # the masks of the masked-prediction picture, so reruns draw the same picture
MASKED_TASK = f"{MaskedPatchPretraining.__module__}.{MaskedPatchPretraining.__name__}"


def analyze(
    source: str,
    urls: str,
    out_dir: str | Path,
    images: int = 256,
    batch_size: int = 64,
    overwrite: bool = False,
    display_bands: tuple[int, int, int] | None = None,
) -> dict:
    """Analyse the checkpoint `source` (any kind `load_backbone` reads) on the first `images` images of
    the shards `urls`; write the pictures and analysis.json into `out_dir`. Returns the json record.
    `display_bands`: the bands drawn as red, green and blue for checkpoints of other than 3 bands."""
    start = time.time()
    data = [
        Input(folder, f"the --data shards' directory {folder}")
        for folder in shard_directories(urls, "--data")
    ]
    with Output(out_dir, "analyze", [*checkpoint_inputs(source), *data], overwrite) as output:
        if images < 1 or batch_size < 1:
            raise UserError(f"--images {images} and --batch-size {batch_size} must be positive")
        record, drawings = _analysis(source, urls, images, batch_size, display_bands)
        record["seconds"] = round(time.time() - start, 1)
        with output.staged() as temp:  # the numbers first: a picture that fails costs only that picture
            (temp / "analysis.json").write_text(json.dumps(record, indent=1) + "\n")
        drawn = [output.picture(name, draw) for name, draw in drawings.items()]
        record["pictures"] = sorted(path.name for path in drawn if path is not None)
        output.optional("the W&B log", lambda: _log_to_wandb(record, output.path))
        if output.notes:  # what failed, said beside the numbers
            record["notes"] = output.notes
            output.rewrite("analysis.json", json.dumps(record, indent=1) + "\n")
    return record


def _analysis(
    source: str, urls: str, images: int, batch_size: int, display_bands: tuple[int, int, int] | None
) -> tuple[dict, dict]:
    """The json record of `analyze` and its pictures: name -> a function that draws it at a path."""
    checkpoint = mapped_checkpoint(source)
    hparams = upgraded_hparams((checkpoint or {}).get("hyper_parameters") or {})
    training = hparams.get("training", {})
    backbone, config = load_backbone(source)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backbone.to(device).eval()
    rgb = config.in_chans == 3
    shown_bands = check_display_bands(display_bands or hparams.get("display_bands"), config.in_chans)
    # The normalisation the checkpoint was trained with; for files that do not record it (exported
    # .safetensors, timm: weights) timm's ImageNet statistics for RGB, the manifest's for other bands.
    mean, std = (
        tuple(training["mean"]) if "mean" in training else IMAGENET_DEFAULT_MEAN if rgb else "auto",
        tuple(training["std"]) if "std" in training else IMAGENET_DEFAULT_STD if rgb else "auto",
    )
    # A few hundred images: decoded in this process, without starting DataLoader workers.
    data = ShardDataModule(
        test_urls=urls, batch_size=batch_size, num_workers=0, image_size=config.img_size,
        channels=config.in_chans, mean=mean, std=std,
    )  # fmt: skip
    inputs, keys = read_images(data, "test", images)

    per_head = attention.attention_distance(backbone, inputs, batch_size)  # (L, H)
    similarity = embeddings.position_similarity(backbone).cpu()  # (N, N)
    filters = embeddings.patch_filter_components(backbone, display_bands=shown_bands)
    shown = inputs[:ROLLOUT_IMAGES]
    maps = attention.rollout_maps(backbone, shown)  # (n, gh, gw)
    if rgb:
        scale, shift = torch.tensor(std).view(1, 3, 1, 1), torch.tensor(mean).view(1, 3, 1, 1)
        pixels = (shown * scale + shift).clamp(0, 1)
    else:  # standardised or raw, the same picture: the percentile stretch undoes any scale and offset
        pixels = false_colour(shown, shown_bands)
    masked, masked_picture = _masked_predictions(checkpoint, hparams, shown, device, shown_bands)

    record = {
        "checkpoint": source,
        "backbone": asdict(config),
        "data": urls,
        **({} if rgb else {"display_bands": list(shown_bands)}),
        "images": len(keys),
        "attention_distance": {
            "unit": "pixels",
            "pixels_per_token": backbone.pixels_per_token,
            "class_token": "not a query; attention to it dropped, the rest renormalised over patches",
            "per_head": _rounded(per_head),  # [layer][head]
            "mean_per_layer": _rounded(per_head.mean(1)),
        },
        "position_embedding_similarity": {"grid": list(backbone.grid_size), "matrix": _rounded(similarity)},
        "patch_embedding_pca": (
            {"skipped": "hybrid backbone: its patch embedding acts on ResNet features, not pixels"}
            if filters is None
            else {
                "components": len(filters[1]),
                "explained_variance_ratio": _rounded(filters[1]),
                **({} if rgb else {"over": f"all {config.in_chans} bands; drawn in the display bands"}),
            }
        ),
        "attention_rollout": {
            "token": "[class]"
            if backbone.cls_token is not None
            else "mean of the patch tokens (GAP backbone)",
            "keys": keys[: len(shown)],
            "maps": _rounded(maps),  # [image][row][col], share of the pooled output's input per patch
        },
        "masked_prediction": masked,
    }
    drawings = {
        "attention_distance.png": partial(
            pictures.attention_distance_plot, per_head, backbone.pixels_per_token
        ),
        "position_embeddings.png": partial(pictures.position_similarity_plot, similarity, backbone.grid_size),
        "attention_rollout.png": partial(pictures.rollout_grid, pixels, maps),
    }
    if filters is not None:
        drawings["patch_embedding_pcs.png"] = partial(pictures.filter_components_grid, filters[0])
    if masked_picture is not None:
        drawings["masked_predictions.png"] = partial(pictures.image_grid, masked_picture, config.img_size)
    record["pictures"] = sorted(drawings)
    return record, drawings


def _masked_predictions(
    checkpoint: dict | None, hparams: dict, images: torch.Tensor, device: str, display_bands: tuple[int, ...]
):
    """(json entry, picture (3, H, W) or None): the masked task rebuilt from the checkpoint's
    hyperparameters and weights, predicting under masks drawn from `MASK_SEED`, drawn in
    `display_bands` (images of other than 3 bands)."""
    if hparams.get(CLASS_PATH_KEY) != MASKED_TASK:
        kind = hparams.get(CLASS_PATH_KEY) or "not a Lightning checkpoint of an ssl-vit task"
        return {"skipped": f"only for masked-pretraining checkpoints ({MASKED_TASK}); this one: {kind}"}, None
    arguments = {key: value for key, value in hparams.items() if key != CLASS_PATH_KEY}
    # Weights come from the checkpoint's state dict below, not from where the run started.
    training = Training(**{**hparams["training"], "init_from": "scratch"})
    arguments.update(backbone=ViTConfig(**hparams["backbone"]), training=training, picture_every_n_steps=0)
    arguments["display_bands"] = display_bands
    task = MaskedPatchPretraining(**arguments)
    task.load_state_dict(checkpoint["state_dict"])
    task.to(device).eval()
    with torch.no_grad():
        out = task.forward_loss(images.to(device), torch.Generator().manual_seed(MASK_SEED))
    entry = {"task": hparams.get("preset") or "masked", "target": task.target_kind, "mask_seed": MASK_SEED}
    entry["loss"] = round(out.loss.item(), 4)
    if out.accuracy is not None:
        entry["masked_accuracy"] = round(out.accuracy.item(), 4)
    if task.teacher is not None:  # latent targets (I-JEPA, data2vec 2.0) have no picture
        return entry, None
    picture = masked_prediction_picture(task.target, task.context, images.to(device), out, count=len(images))
    return entry, picture.cpu()


def _rounded(values: torch.Tensor) -> list:
    return torch.round(values.double().cpu(), decimals=4).tolist()


def _log_to_wandb(record: dict, out: Path) -> None:
    """Into the active W&B run, when there is one (e.g. `ssl-vit analyze` called from a training
    script or notebook that started one): the pictures and the per-layer attention distance."""
    wandb = sys.modules.get("wandb")  # a run can only be active once wandb is imported; never import it here
    if wandb is None or wandb.run is None:
        return
    logged = {
        f"analysis/{name.removesuffix('.png')}": wandb.Image(str(out / name)) for name in record["pictures"]
    }
    table = wandb.Table(columns=["layer", "head", "mean_attention_distance"])
    for layer, heads in enumerate(record["attention_distance"]["per_head"], start=1):
        for head, value in enumerate(heads, start=1):
            table.add_data(layer, head, value)
    wandb.run.log({**logged, "analysis/attention_distance_per_head": table})
