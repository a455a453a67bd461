"""`preset: ijepa`: I-JEPA (Assran et al. 2023): the context encoder sees one large block less four target
blocks; a narrow predictor, given mask tokens at each target block, regresses the EMA teacher's
layer-normed last-layer features there with smooth L1; momentum 0.996 -> 1.0, linear (`src/train.py`)."""

from ssl_vit.presets.preset import Preset, register

register(
    Preset(
        "ijepa",
        corruption="drop",
        target="teacher",
        mask_shape="jepa",
        pixel_loss="smooth_l1",
        teacher_features="final_norm",
        ema_momentum=0.996,
        ema_momentum_end=1.0,
        ema_schedule="linear",
    )
)
