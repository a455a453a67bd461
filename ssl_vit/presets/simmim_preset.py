"""`preset: simmim`: SimMIM (Xie et al. 2022): a mask token in the encoder, 60% of 32-pixel cells, L1 on
the raw pixels of the input as the encoder sees it (standardised, as SimMIM's code regresses its
normalised input), a linear head started as SimMIM's code leaves its 1x1 convolution (PyTorch's own
start)."""

from ssl_vit.presets.preset import Preset, register

register(
    Preset(
        "simmim",
        corruption="mask_token",
        target="seen_pixels",
        mask_ratio=0.6,
        mask_shape="cells",
        pixel_loss="l1",
        head_init="torch",
    )
)
