"""Checkpoint I/O below the tasks: reading any checkpoint kind into a backbone (`load`)."""

from ssl_vit.checkpoints.load import config_metadata, config_of_timm_model, load_backbone

__all__ = ["config_metadata", "config_of_timm_model", "load_backbone"]
