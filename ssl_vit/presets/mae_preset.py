"""`preset: mae`: MAE (He et al. 2021): 75% random masking, the encoder on the visible tokens, an 8 x 512
decoder, normalised pixels, MSE."""

from ssl_vit.presets.preset import register

register(
    "mae", corruption="drop", target="norm_pixels", mask_ratio=0.75, mask_shape="random", pixel_loss="mse"
)
