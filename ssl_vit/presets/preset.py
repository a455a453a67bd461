"""What a masked-prediction preset is: one word (`MaskedPatchPretraining(preset=...)`, a recipe's
`preset: mae`) for the choices of a published method.

A preset is plain data (`Preset`), registered by its own module (`ssl_vit.presets`, or a plugin's:
`ssl_vit.plugins`): the keyword arguments of `MaskedPatchPretraining` it sets. Any argument given
explicitly overrides its preset's value; what neither sets comes from the task's defaults. They are
checked when a task takes the preset, against the targets registered by then. Nothing here imports
torch: `ssl-vit bench --help` lists the presets as tasks.
"""

from __future__ import annotations

from ssl_vit.registry import Registry


class Preset:
    """`preset: NAME` sets `choices`."""

    def __init__(self, name: str, **choices: object) -> None:
        self.name, self.choices = name, choices


PRESETS = Registry("preset")  # name -> its Preset
register = PRESETS.add
