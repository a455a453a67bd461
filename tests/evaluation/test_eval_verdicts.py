"""Verdicts written from the measured table: paired contrasts, claims files and verdicts.md."""

import pytest
import torch
import yaml

from ssl_vit.errors import UserError
from ssl_vit.evaluation.stats import Score, contrast, paired_difference
from ssl_vit.evaluation.suite import load_suite
from ssl_vit.report.verdicts import baseline_text, claims_text, load_claims

BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}
PROTOCOLS = [
    {"name": "fewshot", "kind": "fewshot", "feature": "mean", "shots": [5], "seeds": [0, 1]},
    {"name": "unseen", "kind": "fewshot", "feature": "cls", "shots": [5], "seeds": [0, 1],
     "classes": [5, 6, 7, 8, 9]},
    {"name": "ft", "kind": "finetune", "feature": "mean", "steps": 2, "label_fractions": [0.1, 0.5]},
]  # fmt: skip


def suite_file(path, shards="data/shards/digits", protocols=PROTOCOLS, resamples=200):
    data = {"train_urls": f"{shards}/train-{{000000..000004}}.tar",
            "test_urls": f"{shards}/val-{{000000..000003}}.tar",
            "image_size": 32, "batch_size": 128, "num_workers": 0}  # fmt: skip
    path.write_text(
        yaml.safe_dump({"backbone": BACKBONE, "data": data, "resamples": resamples, "protocols": protocols})
    )
    return path


def claims_file(path, *claims):
    path.write_text(yaml.safe_dump({"claims": list(claims)}))
    return path


def hits(p: float, shape, seed: int) -> Score:
    """An accuracy Score of (R, S, M) correct flags, each right with probability p."""
    return Score.of_correct(torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < p)


# --- contrasts -------------------------------------------------------------------------------------------


def test_a_two_term_contrast_is_the_paired_difference():
    a, b = hits(0.7, (2, 3, 400), 0), hits(0.5, (3, 3, 400), 1)
    assert contrast([(1.0, a, "a"), (-1.0, b, "b")], 300, 5) == paired_difference(a, b, 300, 5)


def test_a_difference_of_differences_is_paired_within_rows_and_columns():
    a1, b1 = hits(0.8, (2, 1, 500), 2), hits(0.4, (2, 1, 500), 3)
    a2, b2 = hits(0.7, (2, 1, 500), 4), hits(0.6, (2, 1, 500), 5)
    found = contrast([(1.0, a1, "a"), (-1.0, b1, "b"), (-1.0, a2, "a"), (1.0, b2, "b")], 400, 0)
    expected = (a1.values.mean() - b1.values.mean()) - (a2.values.mean() - b2.values.mean())
    assert found.mean == pytest.approx(expected.item())
    assert found.low <= found.mean <= found.high and found.verdict == "win"  # 40 points against 10
    # the same runs and images on both sides cancel exactly: a row's edge over itself in one column is 0
    same = contrast([(1.0, a1, "a"), (-1.0, a1, "a")], 200, 0)
    assert (same.mean, same.low, same.high, same.verdict) == (0.0, 0.0, 0.0, "noise")
    with pytest.raises(ValueError, match="same seeds and test images"):
        contrast([(1.0, a1, "a"), (-1.0, hits(0.5, (2, 2, 500), 6), "b")])
    with pytest.raises(ValueError, match="different numbers of runs"):
        contrast([(1.0, a1, "a"), (-1.0, hits(0.5, (3, 1, 500), 6), "a")])


# --- claims ----------------------------------------------------------------------------------------------


def rows_with(suite, accuracies):
    """Rows as `report.aggregate` makes them: per name, per column a Score of (R, S, M) correct flags."""
    columns = suite.columns()
    shapes = {"fewshot_5shot": (2, 2, 600), "unseen_5shot": (2, 2, 300), "ft_10pct": (2, 1, 600),
              "ft_50pct": (2, 1, 600)}  # fmt: skip
    return [
        {"name": name, "error": "", "scores": {c: hits(by_column[c], shapes[c], i) for c in columns}}
        for i, (name, by_column) in enumerate(accuracies.items())
    ]


def test_claims_read_as_holding_within_noise_or_reversed(tmp_path):
    suite = load_suite(suite_file(tmp_path / "suite.yaml"))
    claims = load_claims(claims_file(
        tmp_path / "claims.yaml",
        {"says": "ssl beats scratch", "rows": ["ssl", "twin"], "against": "scratch",
         "columns": ["fewshot_5shot"]},
        {"says": "sup beats ssl on unseen", "rows": "sup", "against": "ssl", "columns": ["unseen_5shot"]},
        {"says": "the edge grows with fewer labels", "rows": "ssl", "against": "scratch",
         "columns": ["ft_10pct"],
         "minus": ["ft_50pct"]},
    ), suite, ["ssl", "twin", "sup", "scratch"])  # fmt: skip
    table = {
        "ssl": {"fewshot_5shot": 0.8, "unseen_5shot": 0.7, "ft_10pct": 0.6, "ft_50pct": 0.7},
        "twin": {"fewshot_5shot": 0.5, "unseen_5shot": 0.7, "ft_10pct": 0.6, "ft_50pct": 0.7},
        "sup": {"fewshot_5shot": 0.6, "unseen_5shot": 0.3, "ft_10pct": 0.6, "ft_50pct": 0.7},
        "scratch": {"fewshot_5shot": 0.5, "unseen_5shot": 0.5, "ft_10pct": 0.3, "ft_50pct": 0.6},
    }
    text = claims_text(claims, rows_with(suite, table), suite)
    lines = text.splitlines()
    ssl = next(line for line in lines if line.startswith("- ssl - scratch on fewshot_5shot"))
    assert "(few-shot, mean patch token)" in ssl and ssl.endswith(": holds beyond noise.")
    assert "- twin - scratch on fewshot_5shot" in text and "within noise" in text
    sup = next(line for line in lines if line.startswith("- sup - ssl on unseen_5shot"))
    assert "[class] token, classes 5-9" in sup and sup.endswith(": reversed.")
    edge = next(line for line in lines if line.startswith("- (ssl - scratch) on ft_10pct"))
    assert "minus (ssl - scratch) on ft_50pct" in edge and edge.endswith(": holds beyond noise.")
    assert (
        "## ssl beats scratch\n\nVerdict: holds beyond noise in 1, within noise in 1 of 2 comparisons."
        in text
    )
    # the numbers are the table's: +30 points, its bounds around it
    mean, low, high = (
        float(v) for v in ssl.split(": ")[1].replace(" points [", " ").replace(",", "").rstrip("]").split()
    )
    assert low < mean < high and 20 < mean < 40


def test_without_claims_a_baseline_gives_one_sentence_per_row(tmp_path):
    from ssl_vit.report.writer import paired

    suite = load_suite(suite_file(tmp_path / "suite.yaml"))
    table = {
        "ssl": {"fewshot_5shot": 0.8, "unseen_5shot": 0.5, "ft_10pct": 0.2, "ft_50pct": 0.6},
        "scratch": {"fewshot_5shot": 0.5, "unseen_5shot": 0.5, "ft_10pct": 0.5, "ft_50pct": 0.6},
    }
    rows = rows_with(suite, table)
    text = baseline_text(paired(rows, suite.columns(), "scratch", suite), "scratch", suite)
    (line,) = [line for line in text.splitlines() if line.startswith("- ")]
    assert line.startswith("- ssl against scratch: above in 1 (fewshot_5shot (few-shot, mean patch token) +")
    assert "; below in 1 (ft_10pct (fine-tuned, mean patch token) -" in line and "within noise in 2 (" in line


@pytest.mark.parametrize(
    "claim, words",
    [
        ({"says": "x", "rows": "nope", "against": "scratch", "columns": ["fewshot_5shot"]},
         "claim 0: rows ['nope'] name no row; rows: a, scratch"),
        ({"says": "x", "rows": "a", "against": "scratch", "columns": ["fewshot_7shot"]},
         "claim 0: columns ['fewshot_7shot'] are not columns of the suite"),
        ({"says": "x", "rows": "a", "against": "scratch", "columns": ["ft_10pct"],
          "minus": ["fewshot_5shot"]},
         "are not scored on the same test images and seeds"),
        ({"says": "x", "rows": "a", "against": "a", "columns": ["ft_10pct"]},
         "rows and against are the same rows"),
        ({"says": "x", "rows": "a", "columns": ["ft_10pct"]}, "claim 0: against is missing"),
        ({"says": "x", "rows": "a", "against": "scratch", "columns": ["ft_10pct"], "than": 1},
         "unknown key than"),
    ],
    ids=["row", "column", "unpaired-minus", "self", "missing", "unknown-key"],
)  # fmt: skip
def test_claims_mistakes_are_one_line_before_anything_runs(claim, words, digits_shards, tmp_path, cli):
    suite = suite_file(tmp_path / "suite.yaml", digits_shards)
    claims = claims_file(tmp_path / "claims.yaml", claim)
    out = tmp_path / "out"
    proc = cli("compare", "a=scratch", "--scratch", "--suite", str(suite), "--claims", str(claims), "--out",
               str(out), check=False)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"ssl-vit: error: {claims}: ") and words in proc.stderr, proc.stderr
    assert not out.exists()


def test_a_missing_claims_file_is_one_line(tmp_path):
    suite = load_suite(suite_file(tmp_path / "suite.yaml"))
    with pytest.raises(UserError, match="claims file .*missing.yaml does not exist"):
        load_claims(tmp_path / "missing.yaml", suite, ["a"])


@pytest.mark.slow
def test_compare_writes_and_prints_the_verdicts(digits_shards, tmp_path, cli):
    protocols = [PROTOCOLS[0], {**PROTOCOLS[1], "feature": "mean"}]
    suite = suite_file(tmp_path / "suite.yaml", digits_shards, protocols)
    claim = {
        "says": "a beats scratch",
        "rows": "a",
        "against": "scratch",
        "columns": ["fewshot_5shot", "unseen_5shot"],
    }
    claims = claims_file(tmp_path / "claims.yaml", claim)
    out = tmp_path / "out"
    proc = cli("compare", "a=scratch", "--scratch", "2", "--baseline", "scratch", "--suite", str(suite),
               "--claims", str(claims), "--out", str(out))  # fmt: skip
    text = (out / "verdicts.md").read_text()
    assert text in proc.stdout and "## a beats scratch" in text and "verdicts.md" in proc.stdout
    assert len([line for line in text.splitlines() if line.startswith("- a - scratch on ")]) == 2
