"""Checkpoint I/O below the tasks: reading any checkpoint kind into a backbone (`load`), MAE's names
(`mae`), and writing backbones (and classifiers) for timm (`export`)."""

from ssl_vit.checkpoints.load import (
    Weights,
    config_metadata,
    config_of_timm_model,
    infer_config,
    load_backbone,
    load_mae_decoder,
    read_weights,
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
