"""Verdicts written from a comparison's paired differences: `ssl-vit compare` writes verdicts.md.

With `--claims FILE`, one verdict per claim: a claim names rows that should beat other rows on some
result columns, optionally by more than in other columns (`minus`: a difference of differences, e.g.
"the edge over scratch is larger at 1% of the labels than at 10%"):

```yaml
claims:
  - says: self-supervised pretraining beats training from scratch
    rows: [mae, mpp]
    against: scratch
    columns: [fewshot_mean_5shot, linear_cls]
  - says: the edge over scratch is larger at fewer labels
    rows: [mae]
    against: scratch
    columns: [finetune_1pct]
    minus: [finetune_10pct]    # one per column: (row - against)[column] - (row - against)[minus]
```

Each comparison (row x against x column) is read from its paired interval (`stats.contrast`): "holds
beyond noise" when the interval lies above 0, "reversed" below 0, "within noise" when it contains 0;
each names the feature its column rests on. The claim's own sentence counts its comparisons by verdict.
Without claims, a `--baseline` gives one sentence per row: the columns where it is above, within noise
of and below the baseline. Nothing is written by hand: the text is a function of the measured table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from ssl_vit.errors import UserError
from ssl_vit.evaluation.stats import LEVEL, Difference, contrast, scored
from ssl_vit.evaluation.suite import Suite, refuse_url

READING = {"win": "holds beyond noise", "noise": "within noise", "loss": "reversed"}
Names = Annotated[list[str], Field(min_length=1)]


@dataclass(config=ConfigDict(strict=True, extra="forbid"))
class Claim:
    says: str  # the claim in words, the verdict's subject
    rows: Names  # rows that should be ahead
    against: Names  # the rows they should be ahead of
    columns: Names  # result columns the claim is read on
    minus: list[str] | None = None  # per column, a column whose (row - against) is subtracted

    def comparisons(self) -> list[tuple[str, str, str, str | None]]:
        """(row, against, column, minus column or None) for every comparison the claim makes."""
        minus = self.minus or [None] * len(self.columns)
        return [
            (row, other, column, less)
            for row in self.rows
            for other in self.against
            if other != row
            for column, less in zip(self.columns, minus)
        ]


def load_claims(path: str | Path, suite: Suite, names: list[str]) -> list[Claim]:
    """Parse and check a claims file against the suite's columns and the comparison's row `names`;
    every problem is one line naming the claim, the key and the fix."""
    refuse_url(str(path), "claims file")
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"claims file {path} does not exist; give a YAML file (see recipes/study/claims.yaml)"
        )
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"claims file {path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("claims"), list) or not raw["claims"]:
        raise UserError(f"{path}: give 'claims:', a non-empty list of {{says, rows, against, columns}}")
    columns = suite.columns()
    claims = []
    for i, values in enumerate(raw["claims"]):
        where = f"{path}: claim {i}"
        if isinstance(values, dict):
            values = {k: [v] if k in ("rows", "against", "columns", "minus") and isinstance(v, str) else v
                      for k, v in values.items()}  # fmt: skip
        try:
            claim = Claim(**values) if isinstance(values, dict) else None
        except (ValidationError, TypeError) as err:
            raise UserError(f"{where}: {_problem(err)}") from None
        if claim is None:
            raise UserError(
                f"{where} is a {type(values).__name__}: give a mapping {{says, rows, against, columns}}"
            )
        for key in ("rows", "against"):
            unknown = [name for name in getattr(claim, key) if name not in names]
            if unknown:
                raise UserError(f"{where}: {key} {unknown} name no row; rows: {', '.join(names)}")
        for key in ("columns", "minus"):
            unknown = [c for c in getattr(claim, key) or [] if c not in columns]
            if unknown:
                raise UserError(
                    f"{where}: {key} {unknown} are not columns of the suite; columns: {', '.join(columns)}"
                )
        if claim.minus is not None:
            if len(claim.minus) != len(claim.columns):
                raise UserError(
                    f"{where}: minus has {len(claim.minus)} columns for {len(claim.columns)}: give one each"
                )
            for column, less in zip(claim.columns, claim.minus):
                if _scored_on(suite, column) != _scored_on(suite, less):
                    raise UserError(
                        f"{where}: {column} and {less} are not scored on the same test images and seeds "
                        "(dataset, classes, few-shot seeds): their difference has no paired interval"
                    )
        if not claim.comparisons():
            raise UserError(f"{where}: rows and against are the same rows: a claim compares two")
        claims.append(claim)
    return claims


def _problem(err: Exception) -> str:
    if not isinstance(err, ValidationError):
        return str(err)
    first = err.errors()[0]
    key = ".".join(str(part) for part in first["loc"])
    if first["type"] in ("missing", "missing_argument"):
        return f"{key} is missing (give says, rows, against, columns)"
    if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"unknown key {key}: valid keys are says, rows, against, columns, minus"
    return f"{key} is {first['input']!r}: {first['msg'][0].lower()}{first['msg'][1:]}"


def _scored_on(suite: Suite, column: str) -> tuple:
    """What makes two columns' statistics pairable: the same test images (dataset, classes) and the same
    support draws (a few-shot protocol's seeds; one for the other kinds)."""
    protocol = suite.protocol_of(column)
    return protocol.dataset, tuple(protocol.classes or ()), protocol.support_draws()


def describe(suite: Suite, column: str) -> str:
    """`fewshot_mean_5shot (few-shot, mean patch token)`: a column and the feature it rests on."""
    return suite.protocol_of(column).describe(column)


def _points(value: float) -> str:
    return f"{100 * value:+.1f}"


def _interval(found: Difference) -> str:
    return f"{_points(found.mean)} points [{_points(found.low)}, {_points(found.high)}]"


def judge(
    claim: Claim, rows: dict[str, dict], suite: Suite
) -> tuple[list[tuple[tuple, Difference]], list[str]]:
    """Each comparison of `claim` with its paired interval, from the rows' Scores per column
    (`report.aggregate`); comparisons with a failed row are left out, and so are those on a column a
    row has no number in (nothing to score), which are returned as the second item (`row on column`)."""
    found, unscored = [], []
    for row, other, column, less in claim.comparisons():
        if rows[row]["error"] or rows[other]["error"]:
            continue
        empty = [
            f"{name} on {c}"
            for name in (row, other)
            for c in (column, less)
            if c and not scored(rows[name]["scores"][c].value())
        ]
        if empty:
            unscored += empty
            continue
        a, b = rows[row]["scores"], rows[other]["scores"]
        terms: list[tuple[float, Any, str]] = [(1.0, a[column], row), (-1.0, b[column], other)]
        if less is not None:
            terms += [(-1.0, a[less], row), (1.0, b[less], other)]
        found.append(((row, other, column, less), contrast(terms, suite.resamples, suite.seed)))
    return found, list(dict.fromkeys(unscored))


def claims_text(claims: list[Claim], rows: list[dict], suite: Suite) -> str:
    """verdicts.md for a claims file: per claim, one sentence of counts and one line per comparison."""
    by_name = {row["name"]: row for row in rows}
    lines = [f"# Verdicts\n\nEach comparison is read from its paired {LEVEL:.0%} interval ({_LEGEND}).\n"]
    for claim in claims:
        found, unscored = judge(claim, by_name, suite)
        counts = [(READING[v], sum(d.verdict == v for _, d in found)) for v in ("win", "noise", "loss")]
        summary = (
            ", ".join(f"{reading} in {n}" for reading, n in counts if n)
            or "no comparison (failed rows, or nothing to score)"
        )
        lines.append(f"## {claim.says}\n\nVerdict: {summary} of {len(found)} comparisons.\n")
        if unscored:
            lines.append(f"- Left out, nothing to score: {'; '.join(unscored)}.")
        for (row, other, column, less), diff in found:
            what = describe(suite, column)
            if less is None:
                lines.append(f"- {row} - {other} on {what}: {_interval(diff)}: {READING[diff.verdict]}.")
            else:
                lines.append(
                    f"- ({row} - {other}) on {what} minus ({row} - {other}) on {less}: {_interval(diff)}: "
                    f"{READING[diff.verdict]}."
                )
        lines.append("")
    return "\n".join(lines)


def baseline_text(differences: dict[str, dict[str, Difference]], baseline: str, suite: Suite) -> str:
    """verdicts.md without claims: per row, the columns where it is above, within noise of and below
    `baseline` (paired differences, `report.paired`)."""
    lines = [
        f"# Verdicts against {baseline}\n\nEach column is read from its paired {LEVEL:.0%} interval "
        f"({_LEGEND}).\n"
    ]
    for name, by_column in differences.items():
        parts = []
        for verdict, words in (("win", "above"), ("noise", "within noise"), ("loss", "below")):
            hits = [
                f"{describe(suite, c)} {_interval(d)}" for c, d in by_column.items() if d.verdict == verdict
            ]
            if hits:
                parts.append(f"{words} in {len(hits)} ({'; '.join(hits)})")
        unscored = [c for c in suite.columns() if c not in by_column]
        if unscored:
            parts.append(f"nothing to score in {len(unscored)} ({', '.join(unscored)})")
        lines.append(f"- {name} against {baseline}: " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n"


_LEGEND = "above 0: holds beyond noise; contains 0: within noise; below 0: reversed"
