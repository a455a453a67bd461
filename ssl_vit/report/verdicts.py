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

Each comparison (row x against x column) is read from its paired interval (`stats.contrast`, `_LEGEND`)
and names the feature its column rests on. The claim's own sentence counts its comparisons by verdict.
Without claims, a `--baseline` gives one sentence per row: the columns where it is above, within noise
of and below the baseline. Nothing is written by hand: the text is a function of the measured table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from typing_extensions import Required, TypedDict

from ssl_vit.errors import BadValue, UserError
from ssl_vit.evaluation.protocol import STRICT
from ssl_vit.evaluation.stats import LEVEL, Difference, contrast, scored
from ssl_vit.evaluation.suite import Suite
from ssl_vit.evaluation.suite_file import FILE, problem, read_yaml

READING = {"win": "holds beyond noise", "noise": "within noise", "loss": "reversed"}


def listed(value: Any) -> Any:
    """One name where a list goes (`rows: mae`): a list of it."""
    return [value] if isinstance(value, str) else value


Names = Annotated[list[str], Field(min_length=1), BeforeValidator(listed)]


class Claim(BaseModel):
    """One claim of a claims file; validated with the comparison it is read on as context (`load_claims`):
    rows it has, columns of its suite."""

    model_config = FILE

    says: str  # the claim in words, the verdict's subject
    rows: Names  # rows that should be ahead
    against: Names  # the rows they should be ahead of
    columns: Names  # result columns the claim is read on
    # per column, a column whose (row - against) is subtracted
    minus: Annotated[list[str] | None, BeforeValidator(listed)] = None

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

    @model_validator(mode="after")
    def _readable(self, info: ValidationInfo) -> Claim:
        """Its rows are the comparison's, its columns the suite's, each `minus` pairs with its column,
        and it compares two rows at least (`info.context`: the suite and the row names; without them,
        its types alone are checked)."""
        if info.context is None:
            return self
        suite, names = info.context
        for key in ("rows", "against"):
            unknown = [name for name in getattr(self, key) if name not in names]
            if unknown:
                raise BadValue(f"{key} {unknown} name no row; rows: {', '.join(names)}")
        columns = suite.columns()
        for key in ("columns", "minus"):
            unknown = [c for c in getattr(self, key) or [] if c not in columns]
            if unknown:
                raise BadValue(f"{key} {unknown} are not columns of the suite; columns: {', '.join(columns)}")
        if self.minus is not None:
            _check_minus(self, suite)
        if not self.comparisons():
            raise BadValue("rows and against are the same rows: a claim compares two")
        return self


def _check_minus(claim: Claim, suite: Suite) -> None:
    """One `minus` column per column, each scored on the same test images and seeds as its column."""
    if len(claim.minus) != len(claim.columns):
        raise BadValue(f"minus has {len(claim.minus)} columns for {len(claim.columns)}: give one each")
    for column, less in zip(claim.columns, claim.minus):
        if _scored_on(suite, column) != _scored_on(suite, less):
            raise BadValue(
                f"{column} and {less} are not scored on the same test images and seeds (dataset, classes, "
                "few-shot seeds): their difference has no paired interval"
            )


class ClaimsFile(TypedDict):
    __pydantic_config__ = STRICT

    claims: Required[Annotated[list[Claim], Field(min_length=1)]]


CLAIMS_FILE = TypeAdapter(ClaimsFile)


def load_claims(path: str | Path, suite: Suite, names: list[str]) -> list[Claim]:
    """Parse and check a claims file against the suite's columns and the comparison's row `names`;
    every problem is one line naming the claim, the key and the fix."""
    raw = read_yaml(path, "claims file", "give a YAML file (see recipes/study/claims.yaml)")
    try:
        return CLAIMS_FILE.validate_python(raw, context=(suite, names))["claims"]
    except ValidationError as err:
        raise UserError(f"{path}{_problem(err.errors()[0])}") from None


def _problem(error: dict) -> str:
    """The first problem of a claims file as `: claim N: ...` (nothing but `: ...` for the file's own)."""
    loc = error["loc"]
    if len(loc) < 2:
        return ": give 'claims:', a non-empty list of {says, rows, against, columns}"
    where = f": claim {loc[1]}"
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, UserError):
        return f"{where}: {cause}"
    if len(loc) == 2:
        return (
            f"{where} is a {type(error['input']).__name__}: give a mapping {{says, rows, against, columns}}"
        )
    if error["type"] == "missing":
        return f"{where}: {loc[2]} is missing (give says, rows, against, columns)"
    if error["type"] in ("extra_forbidden", "invalid_key"):
        return f"{where}: unknown key {loc[2]}: valid keys are says, rows, against, columns, minus"
    return f"{where}: {problem({**error, 'loc': loc[2:]})}"


def _scored_on(suite: Suite, column: str) -> tuple:
    """What makes two columns' statistics pairable: the same test images (dataset, classes) and the same
    support draws (a few-shot protocol's seeds; one for the other kinds)."""
    protocol = suite.protocol_of(column)
    return protocol.dataset, tuple(protocol.classes or ()), protocol.support_draws()


def _points(value: float) -> str:
    return f"{100 * value:+.1f}"


def _interval(found: Difference) -> str:
    return f"{_points(found.mean)} points [{_points(found.low)}, {_points(found.high)}]"


def judge(
    claim: Claim, rows: dict[str, dict], suite: Suite
) -> tuple[list[tuple[tuple, Difference]], list[str]]:
    """Each comparison of `claim` with its paired interval, from the rows' Scores per column
    (`writer.aggregate`); comparisons with a failed row are left out, and so are those on a column a
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
            what = suite.protocol_of(column).describe(column)
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
    `baseline` (paired differences, `writer.paired`)."""
    lines = [
        f"# Verdicts against {baseline}\n\nEach column is read from its paired {LEVEL:.0%} interval "
        f"({_LEGEND}).\n"
    ]
    for name, by_column in differences.items():
        parts = []
        for verdict, words in (("win", "above"), ("noise", "within noise"), ("loss", "below")):
            hits = [
                f"{suite.protocol_of(c).describe(c)} {_interval(d)}"
                for c, d in by_column.items()
                if d.verdict == verdict
            ]
            if hits:
                parts.append(f"{words} in {len(hits)} ({'; '.join(hits)})")
        unscored = [c for c in suite.columns() if c not in by_column]
        if unscored:
            parts.append(f"nothing to score in {len(unscored)} ({', '.join(unscored)})")
        lines.append(f"- {name} against {baseline}: " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n"


_LEGEND = "above 0: holds beyond noise; contains 0: within noise; below 0: reversed"
