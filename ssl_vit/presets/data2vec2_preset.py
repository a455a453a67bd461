"""`preset: data2vec2`: data2vec 2.0 (Baevski et al. 2022, base image config): 80% masked in blocks
(theirs inverse blocks of 3, BEiT's here), the encoder on the visible tokens, 16 masked views of each
image share one teacher pass; targets the teacher's top 10 blocks (`top_k_mean`); MSE; EMA 0.9998 ->
0.99999, linear."""

from ssl_vit.presets.preset import Preset, register

register(
    Preset(
        "data2vec2",
        corruption="drop",
        target="teacher",
        mask_ratio=0.8,
        mask_shape="block",
        pixel_loss="mse",
        teacher_features="top_k_mean",
        teacher_top_k=10,
        views=16,
        ema_momentum=0.9998,
        ema_momentum_end=0.99999,
        ema_schedule="linear",
    )
)
