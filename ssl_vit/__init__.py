"""ssl-vit: self-supervised and supervised ViT pretraining on one timm backbone, evaluated side by side."""

from ssl_vit import _aliases

_aliases.install()  # modules that moved answer to their old paths too (run configs, users' recipes)

__all__ = ["ViT", "build_vit"]


def __getattr__(name: str):
    # Lazy, so `ssl-vit data ...` and `ssl-vit --help` do not pay for importing timm and torch.
    if name in __all__:
        from ssl_vit.models import vit

        return getattr(vit, name)
    raise AttributeError(f"module 'ssl_vit' has no attribute {name!r}")
