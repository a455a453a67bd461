"""The `hf:DIR` source: a local snapshot of a Hugging Face Hub dataset repository stored as parquet, as
`huggingface-cli download --repo-type dataset ORG/NAME --local-dir DIR` leaves it (or `hf download`).

Which files make the split (`--split`; `--subset` chooses among a repository's configurations):
- the README's YAML front matter, when it lists `configs:` (each a `config_name`, `data_files` as a
  glob, a list of globs or a list of `{split, path}`, optionally `data_dir` and `default: true`), as the
  Hub's viewer and `datasets.load_dataset` read it;
- else the file layouts the Hub writes: `[CONFIG/]data/SPLIT-00000-of-00004.parquet` (`push_to_hub`),
  `[CONFIG/]SPLIT-*.parquet`, `[CONFIG/]SPLIT.parquet`, and `[CONFIG/]SPLIT/*.parquet` (the Hub's
  parquet conversion, `refs/convert/parquet`). A split's name is the file name up to its first `-`.
A repository with several configurations and none marked default needs `--subset`.

Which columns: the `datasets` features that `datasets` keeps in every parquet file's schema metadata
(key `huggingface`, JSON `{"info": {"features": {COLUMN: {"_type": "Image" | "ClassLabel" | ...}}}}`)
mark the image column (`Image`: a struct `{bytes, path}`) and the label column (`ClassLabel`, stored
as integers; its `names` are the manifest's `class_names`); `--image-column` and `--label-column`
name them instead, for files written without those features (a plain binary column of encoded image
files, an integer column). Without a label column the samples are unlabelled (-1), said in a warning.

Every file's footer (schema, row groups, row counts) is read before anything is written: a corrupt
file, a missing column or one of the wrong type is a one-line error naming the file. The rows are then
read one row group at a time (pyarrow's `ParquetFile.read_row_group`, only the two columns), never a
whole file. A row without image bytes (null, or only a `path` to a file outside the parquet), a label
below -1 or outside the ClassLabel's names, and every row of a row group that cannot be read are `Broken`
records, skipped and counted by the writer (a row group's in one line); an image that does not decode is
skipped there too. A null label or -1 is unlabelled. The sample count is known from the footers
(progress, resume).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from ssl_vit.data.convert.encode import ImageBytes
from ssl_vit.data.convert.payload import Broken
from ssl_vit.data.convert.source import Flag, SourceKind, register
from ssl_vit.errors import UserError, first_line, shown

# pyarrow is imported by the functions that read parquet, not here: `ssl-vit --help` lists this source
# without importing pyarrow (tests/test_cli_imports.py).
if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("ssl_vit.data")
LAYOUTS = (
    "a README.md whose front matter lists configs: with data_files, or parquet files named "
    "[CONFIG/]data/SPLIT-00000-of-00001.parquet, [CONFIG/]SPLIT-*.parquet, [CONFIG/]SPLIT.parquet or "
    "[CONFIG/]SPLIT/*.parquet"
)
DOWNLOAD = "huggingface-cli download --repo-type dataset ORG/NAME --local-dir DIR"
DEFAULT_CONFIG = "default"  # the Hub's name for a repository's one configuration
# Labels without ClassLabel names become class names "0" ... "K-1" in the manifest: a label beyond this
# is a garbled value, not a class (ImageNet-21k has 21,841).
MAX_UNNAMED_LABEL = 1_000_000


def _read_errors() -> tuple[type[Exception], ...]:
    """What pyarrow raises for a file it cannot read."""
    import pyarrow as pa

    return (OSError, ValueError, pa.ArrowException)


@dataclass(frozen=True)
class ParquetFile:
    """A file of the split and what its footer says: its columns, and rows per row group."""

    path: Path
    name: str  # relative to DIR (the manifest, skipped rows)
    schema: pa.Schema
    row_groups: tuple[int, ...]


class ParquetRecords:
    """The `(ImageBytes | Broken, label)` records of the split's rows, file by file and row group by row
    group, read afresh by each iteration; one record per row, so `total` is the footers' row count."""

    def __init__(
        self,
        files: list[ParquetFile],
        image: str,
        label: str | None,
        class_names: list[str] | None,
        manifest: dict,
    ):
        self.files, self.image, self.label, self.class_names = files, image, label, class_names
        self.total = sum(sum(f.row_groups) for f in files)
        self.manifest = manifest

    def __iter__(self) -> Iterator[tuple[ImageBytes | Broken, int]]:
        import pyarrow.parquet as pq

        columns = [self.image] + ([self.label] if self.label else [])
        for file in self.files:
            try:
                reader = pq.ParquetFile(file.path)
            except _read_errors() as err:
                yield from _broken_rows(file.name, sum(file.row_groups), err)
                continue
            with reader:
                metadata = reader.metadata
                groups = tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
                if groups != file.row_groups:  # the counts that decided which records are done (resume)
                    raise UserError(
                        f"{file.name} changed while it was being converted (its row groups differ): "
                        "run the command again"
                    )
                row = 0
                for group, rows in enumerate(groups):
                    try:
                        table = reader.read_row_group(group, columns=columns)
                    except _read_errors() as err:
                        yield from _broken_rows(f"{file.name} row group {group}", rows, err)
                    else:
                        yield from self._rows(table, file.name, row)
                    row += rows

    def _rows(self, table: pa.Table, name: str, first: int) -> Iterator[tuple[ImageBytes | Broken, int]]:
        images = table.column(self.image).to_pylist()
        labels = table.column(self.label).to_pylist() if self.label else [None] * len(images)
        for i, (image, label) in enumerate(zip(images, labels)):
            where = f"{name} row {first + i}"
            data = image.get("bytes") if isinstance(image, dict) else image
            if data is None:
                only = f" (only the path {image.get('path')!r})" if isinstance(image, dict) else ""
                yield Broken(f"{where}: no image bytes{only}"), -1
            elif (why := self._bad_label(label)) is not None:
                yield Broken(f"{where}: {why}"), -1
            else:
                yield ImageBytes(data, where), -1 if label is None else label

    def _bad_label(self, label: int | None) -> str | None:
        if label is None or label == -1:
            return None
        if label < -1:
            return f"label {label} is negative"
        if self.class_names is not None and label >= len(self.class_names):
            return f"label {label} is not one of the {len(self.class_names)} ClassLabel names"
        if self.class_names is None and label > MAX_UNNAMED_LABEL:
            return f"label {label} is beyond {MAX_UNNAMED_LABEL:,} classes"
        return None


def _broken_rows(where: str, rows: int, err: BaseException) -> Iterator[tuple[Broken, int]]:
    """A Broken record for each of the `rows` rows of `where`, which could not be read: one reason for
    all of them, which the writer says once."""
    broken = Broken(f"{where} ({rows} row{'s' * (rows != 1)}): {first_line(err)}")
    for _ in range(rows):
        yield broken, -1


def load(
    arg: str, split: str, subset: str | None, image_column: str | None, label_column: str | None
) -> tuple[list[str] | None, ParquetRecords]:
    """`(class names, or None for "from the labels seen"; records)` of split `split` of the snapshot
    `arg`; everything checked that can be before a row is read."""
    import pyarrow as pa

    root = Path(arg)
    if not root.is_dir():
        raise UserError(f"hf:{arg}: no such directory: download the dataset with `{DOWNLOAD}`")
    config, splits = _splits(root, subset, f"hf:{arg}")
    if split not in splits:
        found = ", ".join(sorted(splits))
        raise UserError(
            f"hf:{arg}: no parquet files for split {split!r} (splits: {found}): pass --split SPLIT"
        )
    files = [_footer(path, root) for path in splits[split]]
    first = files[0]
    features = _features(first)
    image = image_column or _marked(features, "Image", "--image-column", first)
    label = label_column or _marked(features, "ClassLabel", "--label-column", first)
    for file in files:
        _check_column(file, image, "--image-column", _is_image, IMAGE_TYPES)
        if label is not None:
            _check_column(file, label, "--label-column", pa.types.is_integer, LABEL_TYPES)
    class_names = _class_names(features.get(label), label, first) if label else None
    if label is None:
        log.warning(
            "hf:%s: no label column (no ClassLabel among the `datasets` features): the samples are written "
            "unlabelled; pass --label-column NAME for an integer column (columns: %s)",
            arg, ", ".join(first.schema.names),
        )  # fmt: skip
    manifest = {
        "hf": {
            "subset": config,
            "image_column": image,
            "label_column": label,
            "files": [file.name for file in files],
        }
    }
    return class_names, ParquetRecords(files, image, label, class_names, manifest)


# --- which files --------------------------------------------------------------------------------------


def _splits(root: Path, subset: str | None, what: str) -> tuple[str, dict[str, list[Path]]]:
    """`(configuration, {split: its parquet files in order})` of the snapshot at `root`."""
    configs, defaults = _card_configs(root, what)
    if not configs:
        configs, defaults = _inferred(root), []
    if not configs:
        raise UserError(f"{what}: no parquet files found; expected {LAYOUTS} (as `{DOWNLOAD}` leaves them)")
    names = ", ".join(sorted(configs))
    if subset is not None:
        if subset not in configs:
            raise UserError(f"{what}: no subset {subset!r} (subsets: {names}): pass --subset NAME")
        chosen = subset
    else:
        marked = defaults or [c for c in configs if c == DEFAULT_CONFIG]
        if len(configs) > 1 and len(marked) != 1:
            raise UserError(f"{what} holds several subsets ({names}), none the default: pass --subset NAME")
        chosen = next(iter(configs)) if len(configs) == 1 else marked[0]
    if not configs[chosen]:
        raise UserError(f"{what}: subset {chosen!r} names no parquet files; only parquet is read ({LAYOUTS})")
    return chosen, configs[chosen]


def _card_configs(root: Path, what: str) -> tuple[dict[str, dict[str, list[Path]]], list[str]]:
    """`({configuration: {split: files}}, the ones marked default)` of the README's `configs:`, ({}, [])
    when it lists none."""
    from huggingface_hub.repocard import metadata_load  # the Hub's own reader of a card's front matter

    card = root / "README.md"
    if not card.is_file():
        return {}, []
    try:
        metadata = metadata_load(card) or {}
    except Exception as err:  # yaml's errors, a front matter that is not a mapping, undecodable text
        raise UserError(
            f"{what}: the front matter of {card} does not parse ({first_line(err)}): fix it or download it "
            "again"
        ) from None
    entries = metadata.get("configs")
    if entries is None:
        return {}, []
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("config_name"), str) for e in entries
    ):
        raise UserError(
            f"{what}: {card}: 'configs' should be a list of {{config_name, data_files}} entries: fix it or "
            "download it again"
        )
    configs = {e["config_name"]: _card_files(root, e, what) for e in entries}
    return configs, [e["config_name"] for e in entries if e.get("default") is True]


def _card_files(root: Path, entry: dict, what: str) -> dict[str, list[Path]]:
    """`{split: files}` of one entry of the README's `configs:`, its globs matched under its data_dir."""
    base = _inside(root, str(entry.get("data_dir") or "."), root, what)
    if entry.get("data_files") is None:  # only data_dir: the file layouts, inside it
        inferred = _inferred(base)
        return inferred.get(DEFAULT_CONFIG, {}) if len(inferred) == 1 else {}
    splits: dict[str, list[Path]] = {}
    for split, patterns in _patterns(entry["data_files"], what).items():
        files: list[Path] = []
        for pattern in patterns:
            _inside(base, pattern, root, what)
            for match in _matches(base, pattern, what):
                path = _inside(base, match, root, what)
                if path.suffix == ".parquet" and path.is_file() and path not in files:
                    files.append(path)
        if files:
            splits[split] = files
    return splits


def _matches(base: Path, pattern: str, what: str) -> list[str]:
    """The names under `base` a README's glob matches, relative to it. pathlib's glob, not `glob.glob`:
    its `**` does not follow links to folders, so two folders linked into each other end, where
    `glob.glob(recursive=True)` walked them for ever."""
    try:
        return sorted(str(path.relative_to(base)) for path in base.glob(pattern))
    except (ValueError, NotImplementedError) as err:  # an empty or absolute pattern
        raise UserError(f"{what}: README.md: data_files glob {shown(pattern, 80)}: {err}") from None


def _patterns(data_files: object, what: str) -> dict[str, list[str]]:
    """A config's `data_files` as `{split: [glob, ...]}`: a glob or a list of globs is the train split
    (as `datasets.data_files.sanitize_patterns` reads them)."""

    def globs(value: object) -> list[str]:
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(
                f"{what}: README.md: data_files {shown(data_files, 80)} is not a glob, a list of globs or a "
                "list of {split, path} entries: fix it or download it again"
            )
        return value

    if isinstance(data_files, dict):
        return {str(split): globs(value) for split, value in data_files.items()}
    if isinstance(data_files, list) and data_files and all(isinstance(e, dict) for e in data_files):
        out: dict[str, list[str]] = {}
        for entry in data_files:
            out.setdefault(str(entry.get("split", "train")), []).extend(globs(entry.get("path")))
        return out
    return {"train": globs(data_files)}


def _inside(base: Path, name: str, root: Path, what: str) -> Path:
    """`base / name`, which a README names: refused when it leads outside the repository. Checked on
    the names, not the resolved paths: older downloads link the files into the Hub's cache."""
    path = Path(os.path.normpath(os.path.join(os.path.abspath(base), name)))
    if os.path.relpath(path, os.path.abspath(root)).split(os.sep)[0] == "..":
        raise UserError(f"{what}: README.md names {name!r}, outside {root}: fix it or download it again")
    return path


SPLIT_IN_NAME = re.compile(r"([A-Za-z]\w*(?:\.\w+)*)(?:-.*)?")  # the Hub's split names: \w+(\.\w+)*


def _inferred(root: Path) -> dict[str, dict[str, list[Path]]]:
    """`{configuration: {split: files}}` of the parquet files in the Hub's layouts under `root`
    (hidden folders, such as the download's `.cache/`, left out)."""
    configs: dict[str, dict[str, list[Path]]] = {}
    for path in sorted(root.rglob("*.parquet")):
        rel = PurePosixPath(path.relative_to(root).as_posix())
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        dirs = [d for d in rel.parts[:-1] if d != "data"]  # the Hub's data/ folder names nothing
        name = SPLIT_IN_NAME.fullmatch(rel.stem)
        if name:
            split = name.group(1)
        elif dirs:  # SPLIT/0000.parquet
            split, dirs = dirs[-1], dirs[:-1]
        else:
            continue
        if len(dirs) > 1:
            continue
        config = dirs[0] if dirs else DEFAULT_CONFIG
        configs.setdefault(config, {}).setdefault(split, []).append(path)
    return configs


# --- which columns ------------------------------------------------------------------------------------

IMAGE_TYPES = "binary image files, or the `datasets` Image struct {bytes, path}"
LABEL_TYPES = "integers (a ClassLabel or an integer column)"


def _footer(path: Path, root: Path) -> ParquetFile:
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as reader:
            metadata = reader.metadata
            groups = tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
            schema = reader.schema_arrow
    except _read_errors() as err:
        raise UserError(
            f"{path}: not a readable parquet file ({first_line(err)}): download it again (`{DOWNLOAD}`)"
        ) from None
    return ParquetFile(path, path.relative_to(root).as_posix(), schema, groups)


def _features(file: ParquetFile) -> dict[str, dict]:
    """The `datasets` features of a file's schema metadata, {} when there are none or they do not parse
    (said in a warning: the columns then need the flags)."""
    raw = (file.schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return {}
    try:
        features = json.loads(raw)["info"]["features"]
        if not isinstance(features, dict):
            raise TypeError(f"features is a {type(features).__name__}")
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as err:
        log.warning(
            "%s: its schema metadata 'huggingface' holds no `datasets` features (%s): they are not used",
            file.path, first_line(err),
        )  # fmt: skip
        return {}
    return {column: feature for column, feature in features.items() if isinstance(feature, dict)}


def _marked(features: dict, kind: str, flag: str, file: ParquetFile) -> str | None:
    """The one column the features mark as `kind`; None for a label column when there is none."""
    marked = [column for column, feature in features.items() if feature.get("_type") == kind]
    columns = ", ".join(file.schema.names)
    if len(marked) > 1:
        raise UserError(f"{file.path} has several {kind} columns ({', '.join(marked)}): pass {flag} NAME")
    if marked:
        return marked[0]
    if kind == "ClassLabel":
        return None
    raise UserError(
        f"{file.path}: no column is marked as an image (no `datasets` Image feature in its schema metadata): "
        f"pass {flag} NAME (columns: {columns})"
    )


def _is_image(kind: pa.DataType) -> bool:
    import pyarrow as pa

    if pa.types.is_struct(kind):
        index = kind.get_field_index("bytes")
        return index >= 0 and _is_binary(kind.field(index).type)
    return _is_binary(kind)


def _is_binary(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind)


def _check_column(file: ParquetFile, column: str, flag: str, fits, should: str) -> None:
    names = file.schema.names
    if column not in names:
        raise UserError(f"{file.path}: no column {column!r} (columns: {', '.join(names)}): pass {flag} NAME")
    if len(found := file.schema.get_all_field_indices(column)) > 1:  # pyarrow's `field` refuses the name
        raise UserError(
            f"{file.path}: {len(found)} columns are named {column!r}, and which one {flag} means cannot "
            "be told: write the file again with distinct column names"
        )
    kind = file.schema.field(found[0]).type
    if not fits(kind):
        raise UserError(f"{file.path}: column {column!r} holds {kind}, not {should}: pass {flag} NAME of one")


def _class_names(feature: dict | None, column: str, file: ParquetFile) -> list[str] | None:
    """A ClassLabel's names; None (numbered from the labels seen) for another column, or names that are
    not a list of strings (said in a warning)."""
    if feature is None or feature.get("_type") != "ClassLabel":
        return None
    names = feature.get("names")
    if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
        return names
    log.warning(
        "%s: the ClassLabel %r has no list of names (%s): classes are numbered from the labels seen",
        file.path, column, shown(names, 80),
    )  # fmt: skip
    return None


register(
    SourceKind(
        "hf",
        load,
        "DIR",
        help="a local snapshot of a Hugging Face Hub dataset repository in parquet, as `huggingface-cli "
        "download --repo-type dataset ORG/NAME --local-dir DIR` leaves it: the image and label columns found "
        "from its `datasets` Image and ClassLabel features, or named",
        splits="train|validation|test|..., the repository's own",
        flags=(
            Flag(
                "subset",
                "the configuration (subset) to read, one of the README's configs: or a top folder; default: "
                "the only one, or the one marked default",
                metavar="NAME",
            ),
            Flag(
                "image_column",
                "the column of images (encoded image files, or the `datasets` Image struct); default: the "
                "column the `datasets` features mark as Image",
                metavar="NAME",
            ),
            Flag(
                "label_column",
                "the column of integer labels; default: the column the `datasets` features mark as "
                "ClassLabel (its names become the class names), else none (unlabelled)",
                metavar="NAME",
            ),
        ),
    )
)
