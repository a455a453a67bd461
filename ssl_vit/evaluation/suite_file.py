"""What a suite file may hold, typed and checked as it loads (`suite.load_suite`): pydantic in strict
mode, like the protocol kinds (`protocol.STRICT`), and a key the file may not have is refused.

`SuiteFile` is the file's top level, `DataBlock` a data block (`data:`, or each of `datasets:`): the
ShardDataModule arguments the evaluation hands on as they are. Each value is checked by a small
validator that raises the line a user reads (`_line`): counts and seconds as the data module checks them
(`data.checks`), the backbone as `ViTConfig.from_dict` checks it, each protocol as its kind's dataclass;
`file_problem` says pydantic's first error. What needs two places at once (an image size the backbone's
patches must tile, a protocol's dataset) is checked after, by `load_suite`.

Also the YAML reading that the suite and the claims file share (`read_yaml`), and the one line of a
pydantic error in a protocol or a claim (`problem`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BeforeValidator, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError
from typing_extensions import Required, TypedDict

from ssl_vit.data.checks import check_counts, check_seconds
from ssl_vit.errors import BadValue, UserError, shown
from ssl_vit.evaluation import kinds  # noqa: F401  (registers the protocol kinds)
from ssl_vit.evaluation.protocol import PROTOCOLS, STRICT, Protocol
from ssl_vit.models.vit import ViTConfig

# The suite's seed seeds numpy through Lightning's `seed_everything`, which takes 0 to 2^32 - 1; the
# replicates of a group add their index to it.
MAX_SEED = 2**31 - 1
# Bootstrap resamples per interval: 1,000 is the usual; 100,000 already take minutes per column.
MAX_RESAMPLES = 100_000
# Data keys whose null means something (no manifest count, no limit, the default wait); the others'
# null would reach the data module as a value.
NULLABLE_DATA_KEYS = ("num_classes", "max_image_pixels", "loader_timeout_s")
# A suite file's levels: strict, and no key but its own.
FILE = ConfigDict(**STRICT, extra="forbid")


def _line(check: Callable[[Any, str], Any]) -> BeforeValidator:
    """A pydantic validator running `check(value, key)`: the value to keep, or a BadValue whose line
    names the key (pydantic keeps it as the error's cause, `file_problem` says it)."""
    return BeforeValidator(lambda value, info: check(value, info.field_name))


def _given(value: Any, key: str) -> Any:
    if value is None and key not in NULLABLE_DATA_KEYS:
        raise BadValue(f"{key} is null: give a value, or leave the key out for its default")
    return value


def _count(value: Any, key: str) -> Any:
    check_counts({key: _given(value, key)})
    return value


def _seconds(value: Any, key: str) -> Any:
    check_seconds({key: _given(value, key)})
    return value


def _number(value: object) -> bool:
    """A finite YAML number (not a flag)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _per_band(value: Any, key: str) -> Any:
    """`mean` or `std`: one number per band, or auto (the manifest's band_stats, read by the data module)."""
    if _given(value, key) == "auto":
        return value
    if not isinstance(value, list) or not value or not all(_number(v) for v in value):
        raise BadValue(f"{key} is {shown(value)}: it should be a list of numbers, one per channel, or auto")
    if key == "std" and not all(v > 0 for v in value):
        raise BadValue(f"std is {shown(value)}: each channel's std must be above 0")
    return value


def _crop(value: Any, key: str) -> Any:
    if not _number(_given(value, key)) or not 0 < value <= 1:
        raise BadValue(f"{key} is {shown(value)}: it should be a number in (0, 1]")
    return value


def _urls(value: Any, key: str) -> Any:
    """A split's shard URLs (their type is the data module's to check, `check_shard_urls`); train and
    test must be given."""
    if not _given(value, key) and key != "val_urls":
        raise PydanticCustomError("missing", "Field required")
    return value


Count = Annotated[Any, _line(_count)]
Seconds = Annotated[Any, _line(_seconds)]
PerBand = Annotated[Any, _line(_per_band)]
Urls = Annotated[Any, _line(_urls)]


class DataBlock(TypedDict, total=False):
    """A data block: ShardDataModule arguments; train = the probe / support set, test = the evaluation set."""

    __pydantic_config__ = FILE

    train_urls: Required[Urls]
    val_urls: Urls  # where a protocol with candidates chooses (else on images held out of train)
    test_urls: Required[Urls]
    image_size: Count
    batch_size: Count
    num_workers: Count
    channels: Count  # input bands (3 unless given), one count for every dataset of a suite
    mean: PerBand
    std: PerBand
    eval_crop_pct: Annotated[Any, _line(_crop)]
    num_classes: Count  # null: the manifest's count
    seed: Count
    read_retries: Count
    read_timeout_s: Seconds
    loader_timeout_s: Seconds  # null: the default wait
    max_image_pixels: Count  # null: no limit


def _backbone(value: Any, key: str) -> ViTConfig:
    return ViTConfig.from_dict(value or {}, key)


def _datasets(value: Any, key: str) -> Any:
    if not isinstance(value, dict) or not value:
        raise BadValue("datasets should map names to data blocks, e.g. {cifar10: {train_urls: ...}}")
    return value


def _protocols(value: Any, key: str) -> list[Protocol]:
    if not isinstance(value, list) or not value:
        raise BadValue("protocols should be a non-empty list of {name: ..., kind: ...} mappings")
    protocols = [protocol(values, i) for i, values in enumerate(value)]
    names = [p.name for p in protocols]
    if len(set(names)) != len(names):
        raise BadValue(f"protocol names must be unique, got {names}")
    return protocols


def _integer_of(low: int, high: int) -> Callable[[Any, str], Any]:
    def check(value: Any, key: str) -> Any:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise BadValue(f"{key} is {shown(value)}: it should be an integer of {low:,} to {high:,}")
        return value

    return check


class SuiteFile(TypedDict, total=False):
    """A suite file: `data` or `datasets` (name -> data block, each protocol naming its `dataset:`),
    and `protocols`; validated, `backbone` is a `ViTConfig` and `protocols` their kinds' dataclasses."""

    __pydantic_config__ = FILE

    backbone: Annotated[Any, _line(_backbone)]  # for `scratch` and plain weights
    data: DataBlock
    datasets: Annotated[dict[Any, DataBlock], _line(_datasets)]
    protocols: Required[Annotated[Any, _line(_protocols)]]
    seed: Annotated[Any, _line(_integer_of(0, MAX_SEED))]
    resamples: Annotated[Any, _line(_integer_of(100, MAX_RESAMPLES))]  # bootstrap resamples per interval


def file_problem(err: ValidationError) -> str:
    """The one line of a suite file's first problem: a level's unknown keys before its values, and a
    data block's problems after its name (`data` or the dataset's)."""
    errors = err.errors()
    first = errors[0]
    loc = first["loc"]
    extra = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
    for depth in range(len(loc)):
        unknown = [at[-1] for at in extra if at[:-1] == loc[:depth]]
        if unknown:
            valid = ", ".join((DataBlock if depth else SuiteFile).__annotations__)
            return f"{_block(loc[:depth])}unknown keys {sorted(map(str, unknown))}: valid keys are {valid}"
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, UserError):
        return f"{_block(loc)}{cause}"
    name = loc[1] if loc[0] == "datasets" else loc[0]  # of the data block
    if first["type"] == "missing":
        return f"{name}.{loc[-1]} is missing (train: probe/support, test: evaluation)"
    if first["type"] == "dict_type":
        keys = ", ".join(DataBlock.__annotations__)
        return f"{name} is a {type(first['input']).__name__}, not a mapping: give keys among {keys}"
    return problem(first)


def _block(loc: tuple) -> str:
    """`data: ` or `NAME: ` where `loc` is a data block or lies inside one."""
    if loc[:1] == ("data",):
        return "data: "
    return f"{loc[1]}: " if loc[:1] == ("datasets",) and len(loc) > 1 else ""


def protocol(values: Any, index: int) -> Protocol:
    """The suite file's protocol number `index`, as its kind's dataclass."""
    where = f"protocol {index}"
    if not isinstance(values, dict):
        raise BadValue(f"{where} is a {type(values).__name__}, not a mapping: give at least name and kind")
    if isinstance(values.get("name"), str):
        where = f"protocol {values['name']!r}"
    kind = values.get("kind")
    try:
        cls = PROTOCOLS.pick(kind)
    except BadValue as err:
        raise BadValue(f"{where}: {err}") from None
    known = [f.name for f in fields(cls)]
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise BadValue(f"{where} ({kind}): unknown keys {unknown}: valid keys are {', '.join(known)}")
    try:
        return cls(**values)
    except ValidationError as err:
        raise BadValue(f"{where}: {problem(err.errors()[0])}") from None


def problem(error: dict) -> str:
    """One pydantic error of a protocol or a claim as `KEY is VALUE: what it should be` (`lrs[1]` in a
    list), or `KEY is missing`."""
    key = "".join(f"[{part}]" if isinstance(part, int) else str(part) for part in error["loc"][:2])
    if error["type"] in ("missing", "missing_argument"):
        return f"{key} is missing"
    value, message = error["input"], error["msg"]
    text = f"{key} is {shown(value)}: {message[0].lower()}{message[1:]}"
    if isinstance(value, str) and _is_number(value):
        text += " (YAML reads a number without a dot, such as 1e-3, as text: write 1.0e-3)"
    return text


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_yaml(path: str | Path, what: str, fix: str) -> Any:
    """The YAML of a local file the user names (`what`: the suite, the claims file); one line for a URL,
    a file that is not there (`fix` says what to give) or text that is not YAML."""
    if "://" in str(path) or str(path).startswith("pipe:"):  # it would reach `Path` as `http:/...`
        raise UserError(f"{what} {path} is a URL: give a local file (fetch it first, e.g. with curl -o FILE)")
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} {'is a directory' if path.is_dir() else 'does not exist'}; {fix}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"{what} {path} is not valid YAML ({str(err).splitlines()[0]})") from None
