"""The masked-prediction presets, one module each (`preset.py` says what a preset is). Importing this
package registers them all (`PRESETS`), in the order messages list them; it imports no torch."""

# The order presets are listed in: the ViT paper's first, then by when their papers appeared.
# isort: off
from ssl_vit.presets.preset import PRESETS, Preset, register
from ssl_vit.presets import vit_mpp_preset, mae_preset, simmim_preset, maskfeat_preset  # noqa: F401
from ssl_vit.presets import ijepa_preset, data2vec2_preset  # noqa: F401

# isort: on

__all__ = ["PRESETS", "Preset", "register"]
