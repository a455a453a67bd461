"""Benchmarks of the training step, the whole training loop and multi-process scaling, each reported
as ratios against a reference measured in the same process (`ssl-vit bench step|loop|scaling`)."""
