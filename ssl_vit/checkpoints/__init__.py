"""Checkpoint I/O below the tasks: reading any checkpoint kind into a backbone (`load`), MAE's names
(`mae`), and writing backbones (and classifiers) for timm (`export`)."""

from ssl_vit.checkpoints.load import *  # noqa: F403  (the loader's public names, listed there)
from ssl_vit.checkpoints.load import __all__  # noqa: F401
