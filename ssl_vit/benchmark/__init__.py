"""Benchmarks of the training step, the whole training loop and multi-process scaling, each reported
as ratios against a reference measured in the same process (`ssl-vit bench step|parts|loop|scaling`)."""

from ssl_vit.presets import PRESETS

PRECISIONS = {"32-true": "float32", "bf16-mixed": "bfloat16", "16-mixed": "float16"}  # Lightning's: torch's
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def model_name(config: dict) -> str:
    """A report's variant, and its depth where `--depth` gave one: "Ti/8", "Ti/8 (2 blocks deep)"."""
    depth = config.get("depth")
    return config["variant"] + (f" ({depth} blocks deep)" if depth else "")


def __getattr__(name: str):
    # `TASKS`: supervised, then every masked preset registered when it is read (a plugin's included). Here
    # rather than in `step`, and from the torch-free presets, so that the parsers of `ssl-vit bench` need
    # not import torch and Lightning.
    if name == "TASKS":
        return ("supervised", *PRESETS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
