"""Checkpoint I/O below the tasks: any checkpoint read into a backbone (`load`, with MAE's names in
`mae` and the peers' MAE checkpoints in `peers`), backbones written for timm (`export`), a run's
Lightning checkpoint files (`store`) and the CRC-32 check every load makes first (`integrity`).

The loader's names are imported on first use, so that `ssl-vit --help` and the parsers of `evaluate`,
`compare` and `export` do not pay for importing torch and timm.
"""

# What every command that takes a checkpoint accepts (the loader's error messages repeat it).
SOURCES = (
    "a Lightning .ckpt, a .safetensors, an exported folder, a .pth/.bin of timm or MAE weights, "
    "timm:MODEL_NAME or scratch"
)

__all__ = [
    "Weights",
    "config_metadata",
    "config_of_timm_model",
    "infer_config",
    "load_backbone",
    "load_mae_decoder",
    "read_weights",
]


def __getattr__(name: str):
    if name in __all__:
        from ssl_vit.checkpoints import load

        return getattr(load, name)
    raise AttributeError(f"module 'ssl_vit.checkpoints' has no attribute {name!r}")
