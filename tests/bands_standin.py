"""A stand-in for the multispectral data side, for the model side's tests of N-band data: `install()`
gives `ShardDataModule`, in place, the interface a data module of N bands has (`channels`, and `mean` /
`std` with one value per band, resolved on the instance) and N-band batches, made from RGB shards by
repeating their bands (R, G, B, R, G, ...) and normalising each band with its own mean and std.

In place, so that every data module ssl-vit builds (the fit's, the few-shot monitor's, the evaluation
suites', `analyze`'s) is one; in a test with pytest's `monkeypatch` (undone after it), in a command's
process with `PRELUDE` (`run_cli(..., prelude=PRELUDE)`).

The repeated bands are what `adapt_input_conv` is exact on (timm: RGB weights repeated over the bands and
scaled by 3 / C), which the tests use.

Only while the data module does not read N-band shards itself: one that does refuses RGB shards whose
manifest says 3 channels for `channels` 5, and the tests using this module then read shards of N bands
written by `ssl-vit data convert tiff:DIR` instead.
"""

import inspect
from pathlib import Path

import torch

# `run_cli(..., prelude=PRELUDE)`: the command's process runs with the stand-in installed.
HERE = str(Path(__file__).parent)
PRELUDE = f"import sys; sys.path.insert(0, {HERE!r}); import bands_standin; bands_standin.install()"


def tiled(images: torch.Tensor, channels: int) -> torch.Tensor:
    """(B, 3, H, W) -> (B, channels, H, W): band c is RGB band c % 3."""
    return images[:, [band % 3 for band in range(channels)]]


def install(monkeypatch=None) -> None:
    """Give `ShardDataModule` `channels` and per-band `mean`/`std` (its constructor's signature too, which
    the fit CLI reads) and N-band batches; with `monkeypatch`, undone after the test."""
    from ssl_vit.data import ShardDataModule

    cls = ShardDataModule
    rgb_init = cls.__init__
    signature = inspect.signature(rgb_init)
    rgb_defaults = {name: signature.parameters[name].default for name in ("mean", "std")}

    def __init__(
        self, *args, channels: int = 3, mean=rgb_defaults["mean"], std=rgb_defaults["std"], **kwargs
    ):
        rgb_init(self, *args, **kwargs)  # the RGB shards' own pipeline, normalised below
        for name, values in (("mean", mean), ("std", std)):
            if len(values) != channels:
                raise ValueError(f"{name} has {len(values)} values for {channels} bands")
        self.channels, self.mean, self.std = channels, tuple(mean), tuple(std)

    def prepare_batch(self, batch: dict) -> dict:
        # The loaders' uint8 RGB images in model units ([0, 1]), their bands repeated, each normalised.
        units = tiled(batch["image"], self.channels).float() / 255  # (B, C, H, W)
        mean = torch.tensor(self.mean, device=units.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=units.device).view(1, -1, 1, 1)
        return {**batch, "image": (units - mean) / std}

    bands = [
        inspect.Parameter("channels", inspect.Parameter.KEYWORD_ONLY, default=3, annotation=int),
        *(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=tuple[float, ...]
            )
            for name, default in rgb_defaults.items()
        ),
    ]
    kept = [p for p in signature.parameters.values() if p.name not in ("channels", "mean", "std")]
    positional = [p for p in kept if p.kind != inspect.Parameter.KEYWORD_ONLY]
    keyword = [p for p in kept if p not in positional]
    __init__.__signature__ = signature.replace(parameters=[*positional, *bands, *keyword])
    __init__.__doc__ = rgb_init.__doc__
    for name, value in (("__init__", __init__), ("prepare_batch", prepare_batch)):
        if monkeypatch is None:
            setattr(cls, name, value)
        else:
            monkeypatch.setattr(cls, name, value)
