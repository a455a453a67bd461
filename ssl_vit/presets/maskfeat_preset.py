"""`preset: maskfeat`: MaskFeat (Wei et al. 2022): a mask token in the encoder, 40% BEiT block masks, the
HOG of the masked patches regressed with MSE by a linear head."""

from ssl_vit.presets.preset import Preset, register

register(
    Preset(
        "maskfeat",
        corruption="mask_token",
        target="hog",
        mask_ratio=0.4,
        mask_shape="block",
        pixel_loss="mse",
    )
)
