"""`ssl-vit info`: parameter counts and FLOPs, checked against published numbers."""

import pytest
from test_errors import error_line

from ssl_vit.models.cost import mae_cost, vit_cost


def test_b16_flops_match_timm_published_17_6_gmacs():
    cost = vit_cost("B/16", 224)
    assert abs(cost.flops / 2e9 - 17.6) / 17.6 < 0.02
    assert round(cost.params / 1e6, 1) == 85.8


@pytest.mark.parametrize("variant, ratio", [("B/16", 1.8), ("L/16", 3.0)])
def test_mae_costs_the_papers_fraction_of_supervised(variant, ratio):
    """MAE paper: with the 8 x 512 decoder, about 1/1.8 (ViT-B) and 1/3 (ViT-L) of supervised FLOPs."""
    assert vit_cost(variant).flops / mae_cost(variant).flops == pytest.approx(ratio, rel=0.05)


def test_info_command_prints_the_table(cli):
    out = cli("info", "--variants", "B/16", "R50+B/16", "--img-size", "224").stdout
    assert "B/16" in out and "85.8" in out and "1.80x" in out
    assert f"{(vit_cost('B/16').flops + mae_cost('B/16').flops) / 1e9:.1f}" in out  # MAE + EMA teacher
    assert "R50+B/16" in out and "97.9" in out


def test_info_rejects_an_unknown_variant(cli):
    proc = cli("info", "--variants", "Q/16", check=False)
    assert proc.returncode == 2
    assert "unknown ViT variant 'Q/16'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["--img-size", "0"], ["--img-size 0", "multiple of B/16's 16-pixel patches"]),
        (["--img-size", "100"], ["--img-size 100", "multiple of B/16's 16-pixel patches"]),
        (["--mask-ratio", "1.5"], ["--mask-ratio 1.5", "keeps a patch"]),
        (["--mask-ratio", "0.999"], ["--mask-ratio 0.999", "keeps a patch"]),
        (["--decoder-dim", "0"], ["--decoder-dim 0", "multiple of the decoder's 16 heads"]),
        (["--decoder-dim", "40"], ["--decoder-dim 40", "multiple of the decoder's 16 heads"]),
        (["--decoder-depth", "0"], ["--decoder-depth 0", "at least 1 block"]),
    ],
)
def test_info_mistakes_are_one_line(cli, arguments, words):
    proc = cli("info", "--variants", "B/16", *arguments, check=False)
    error_line(proc, *words)
    assert proc.stdout == ""  # no table printed
