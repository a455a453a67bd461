from ssl_vit.models.vit import VARIANTS, Tokens, ViT, ViTConfig, build_vit, parse_variant

__all__ = ["VARIANTS", "Tokens", "ViT", "ViTConfig", "build_vit", "parse_variant"]
