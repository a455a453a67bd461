"""`preset: simmim`: SimMIM (Xie et al. 2022): a mask token in the encoder, 60% of 32-pixel cells, raw
pixels, L1, a linear head started as SimMIM's code leaves its 1x1 convolution (PyTorch's own start)."""

from ssl_vit.presets.preset import Preset, register

register(
    Preset(
        "simmim",
        corruption="mask_token",
        target="pixels",
        mask_ratio=0.6,
        mask_shape="cells",
        pixel_loss="l1",
        head_init="torch",
    )
)
