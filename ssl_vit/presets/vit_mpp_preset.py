"""`preset: vit_mpp`: the ViT paper's masked patch prediction (appendix B.1.2): corrupt 50% of the patch
embeddings 80/10/10, predict their 3-bit mean colours."""

from ssl_vit.presets.preset import Preset, register

register(Preset("vit_mpp", corruption="bert", target="color3bit", mask_ratio=0.5, mask_shape="random"))
