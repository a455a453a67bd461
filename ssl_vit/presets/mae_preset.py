"""`preset: mae`: MAE (He et al. 2021): 75% random masking, the encoder on the visible tokens, an 8 x 512
decoder, normalised pixels, MSE; the encoder initialised as MAE's code does (fixed sin-cos position
embeddings, xavier-uniform linears)."""

from ssl_vit.presets.preset import Preset, register

register(
    Preset(
        "mae",
        corruption="drop",
        target="norm_pixels",
        mask_ratio=0.75,
        mask_shape="random",
        pixel_loss="mse",
        encoder_init="mae",
    )
)
