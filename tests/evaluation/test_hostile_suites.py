"""Property tests (hypothesis) of the readers of suite and claims files: any value of any YAML type at any
place (null, a list or a mapping where a scalar goes, a `class_path` mapping, huge or negative numbers,
numbers as text) is read, or refused with one UserError, the CLI's one line, before anything runs. In
process on what `evaluate` and `compare` call first (`load_suite`, `check_inputs`, the data modules
the evaluation builds, `load_claims`): a sweep of every place with each kind of wrong value, then
generated edits of up to two places; a few refused cases through the CLI too, with the same line.

Bounded: derandomized (the same cases on every run), a few hundred cases in all, no deadline."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from cli_helpers import LIMITED, billion_laughs, run_cli
from hostile_helpers import HOSTILE, WRONG, bounded, places, replaced
from hypothesis import given
from hypothesis import strategies as st
from test_errors import error_line

from ssl_vit.errors import UserError
from ssl_vit.evaluation.cache import FeatureCache
from ssl_vit.evaluation.suite import check_inputs, load_suite
from ssl_vit.report.verdicts import load_claims

VALUES = st.one_of(
    HOSTILE,
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["1e-3", "12", "fewshot", "S/8", "-1", "nan", "", ["fewshot"], [[1]], {"a": None}]),
)


def base_suite(shards: Path) -> dict:
    """A suite with every kind and every data key, valid as it is."""
    return {
        "backbone": {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2},
        "data": {
            "train_urls": str(shards / "train-{000000..000004}.tar"),
            "test_urls": str(shards / "val-{000000..000003}.tar"),
            "image_size": 32, "batch_size": 16, "num_workers": 0, "mean": [0.5, 0.5, 0.5],
            "std": [0.2, 0.2, 0.2], "eval_crop_pct": 0.9, "num_classes": 10, "seed": 1, "read_retries": 1,
            "read_timeout_s": 5.0, "loader_timeout_s": 10.0, "max_image_pixels": 100000,
        },
        "seed": 0,
        "resamples": 100,
        "protocols": [
            {"name": "fs", "kind": "fewshot", "shots": [1, 5], "seeds": [0], "classes": [1, 2], "ridge": 9.0},
            {"name": "knn", "kind": "knn", "k": 5, "temperature": 0.1, "feature": "mean"},
            {"name": "lin", "kind": "linear_probe", "steps": 2, "lrs": [0.1], "optimizer": "sgd"},
            {"name": "att", "kind": "attentive_probe", "steps": 2, "lrs": [0.1], "weight_decays": [0.0]},
            {"name": "ft", "kind": "finetune", "steps": 2, "label_fractions": [0.5, 1.0]},
        ],
    }  # fmt: skip


def read_suite(path: Path) -> None:
    """What `evaluate` does with a suite before its first forward pass."""
    suite = load_suite(path)
    check_inputs({"scratch": ["scratch"]}, suite)
    for data in suite.datasets.values():
        FeatureCache.datamodule_of(data)


def test_every_place_of_a_suite_takes_every_wrong_type(digits_shards, tmp_path):
    """A sweep before the generated cases: each place of the suite, each kind of wrong value. Any other
    exception fails it; a refusal is one line; a place that takes every kind of wrong value (null, a
    flag, a list, a mapping, huge and negative numbers, text) has lost its check."""
    valid = base_suite(digits_shards)
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(valid))
    read_suite(path)  # the suite itself is valid
    unchecked = []
    for at in places(valid):
        refused = 0
        for value in WRONG:
            path.write_text(yaml.safe_dump(replaced(valid, at, value)))
            try:
                read_suite(path)
            except UserError as err:
                assert "\n" not in str(err), (at, value, str(err))
                refused += 1
        if not refused:
            unchecked.append(at)
    assert not unchecked, unchecked


@pytest.mark.timeout(300)
def test_suites_of_any_yaml_type_are_read_or_one_line(digits_shards, tmp_path):
    valid = base_suite(digits_shards)
    where = places(valid) + [("protocols", 0, "kind"), ("data", "extra"), ("protocols", 1, "dataset")]
    refused: list[tuple[str, str]] = []  # (suite text, the line) for the CLI

    @bounded(400)
    @given(st.lists(st.tuples(st.sampled_from(where), VALUES), min_size=1, max_size=2))
    def suites(edits):
        suite = valid
        for at, value in edits:
            suite = replaced(suite, at, value)
        text = yaml.safe_dump(suite)
        path = tmp_path / "suite.yaml"
        path.write_text(text)
        try:
            read_suite(path)
        except UserError as err:
            if len(refused) < 4:
                refused.append((text, str(err)))

    suites()
    assert refused
    for i, (text, line) in enumerate(refused):
        (tmp_path / "suite.yaml").write_text(text)
        out = tmp_path / f"out-{i}"
        proc = run_cli("evaluate", "scratch", "--suite", str(tmp_path / "suite.yaml"), "--out", str(out),
                       check=False)  # fmt: skip
        assert proc.returncode == 2 and proc.stderr == f"ssl-vit: error: {line}\n", (line, proc.stderr)
        assert not out.exists()


CLAIMS = {
    "claims": [
        {"says": "x", "rows": ["a"], "against": ["b"], "columns": ["knn", "fs_1shot"],
         "minus": ["knn", "fs_5shot"]},
        {"says": "y", "rows": "a", "against": "b", "columns": "lin"},
    ]
}  # fmt: skip


def test_claims_of_any_yaml_type_are_read_or_one_line(digits_shards, tmp_path):
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(base_suite(digits_shards)))
    suite = load_suite(path)
    valid = CLAIMS
    for at in places(valid):  # a sweep of each place and each kind of wrong value first
        for value in WRONG:
            (tmp_path / "claims.yaml").write_text(yaml.safe_dump(replaced(valid, at, value)))
            try:
                load_claims(tmp_path / "claims.yaml", suite, ["a", "b"])
            except UserError:
                pass
    refused: list[tuple[str, str]] = []

    @bounded(200)
    @given(st.lists(st.tuples(st.sampled_from(places(valid)), VALUES), min_size=1, max_size=2))
    def claims(edits):
        found = valid
        for at, value in edits:
            found = replaced(found, at, value)
        text = yaml.safe_dump(found)
        (tmp_path / "claims.yaml").write_text(text)
        try:
            load_claims(tmp_path / "claims.yaml", suite, ["a", "b"])
        except UserError as err:
            if len(refused) < 2:
                refused.append((text, str(err)))

    claims()
    for text, line in refused:
        (tmp_path / "claims.yaml").write_text(text)
        claims_path, out = str(tmp_path / "claims.yaml"), str(tmp_path / "out")
        proc = run_cli("compare", "a=scratch", "b=scratch", "--suite", str(path), "--claims", claims_path,
                       "--out", out, check=False)  # fmt: skip
        assert proc.returncode == 2 and proc.stderr == f"ssl-vit: error: {line}\n", (line, proc.stderr)


def test_a_suite_value_of_yaml_aliases_is_one_short_line_within_memory(tmp_path):
    """A suite whose `resamples` is a few hundred bytes of YAML aliases (9^9 shared items once loaded):
    the message quotes the value, bounded in what its repr builds, under a 1 GiB memory limit."""
    suite = tmp_path / "suite.yaml"
    laughs = [f"  {line}" for line in billion_laughs()]  # a mapping of anchors, the last 9^9 items
    rest = ["protocols: [{name: knn, kind: knn}]", "data: {train_urls: a.tar, test_urls: b.tar}"]
    suite.write_text("\n".join(["resamples:", *laughs, *rest]) + "\n")
    proc = run_cli("evaluate", "scratch", "--suite", str(suite), "--out", str(tmp_path / "out"),
                   check=False, prelude=LIMITED)  # fmt: skip
    line = error_line(proc, "resamples")
    assert len(line) < 400 and "MemoryError" not in proc.stderr, line
    assert not (tmp_path / "out").exists()
