"""The registry of the image sources that `ssl-vit data convert` turns into shards (one module per source
beside it, in `ssl_vit.data.convert`).

A source module registers a `SourceKind` (its name, loader, argument, help, splits and flags: see
there). The command's help, its `--split` help, its flags and the checks of a SOURCE string are all
derived from the registry (`SOURCES`), so adding a source is one module and one registration. A plugin
adds one the same way:

    from ssl_vit.data.convert import Flag, SourceKind, register

    def load(arg: str, split: str, tile: int | None) -> tuple[list[str], list]:
        ...

    register(SourceKind("tiles", load, "DIR", flags=(Flag("tile", "...", type=int, metavar="N"),)))

A SOURCE string (`ssl-vit data convert SOURCE`) is parsed into a `Source`: a name, class names and its
records (what a record is: `ssl_vit.data.convert.payload`). Records are a list, or for `wds:` and `hf:`
an iterable read lazily (a large set of shards or parquet files is never held in memory); such an
iterable says its length, where known, as `total`, and what it adds to the manifest as `manifest`.

Each loader validates what it reads and raises `UserError` with a one-line message naming the file
and what is wrong with it, before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssl_vit.errors import BadValue, UserError
from ssl_vit.registry import Registry
from ssl_vit.storage.outdir import Input

# `data convert`'s own options (argparse destinations): no source's flag may take one of these names.
CONVERT_OPTIONS = (
    "source", "outdir", "split", "shard_size", "image_format", "format", "quality", "max_side", "workers",
    "overwrite", "progress", "help",
)  # fmt: skip


@dataclass(frozen=True)
class Flag:
    """A `data convert` flag that belongs to one source: `--NAME` (underscores as dashes), handed to its
    loader as the keyword argument NAME, None when not given; refused with any other source. A
    `required` one is refused missing, in one line with its `help`."""

    name: str
    help: str
    type: Callable[[str], Any] = str
    metavar: str = "VALUE"
    required: bool = False

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    def usage(self) -> str:
        text = f"{self.option} {self.metavar}"
        return text if self.required else f"[{text}]"


@dataclass(frozen=True)
class SourceKind:
    """A source: `load(arg, split, **flags) -> (class names or None, records)` reads `name:ARG` on the
    command line (`argument` None: `name` alone, and `arg` is ""). `splits`: the split names `--split`
    selects among, for the help (the loader refuses others). `masks`: every record carries a
    segmentation mask, and the class names are the mask's classes. `arrays`: its payloads encode arrays,
    stored as `.npy` (`tiff.ArrayFile`). `flags`: the source's own `data convert` flags. `inputs`: the
    local files and folders the SOURCE string names, which OUTDIR must keep out of (by default the
    paths of `arg` split at commas)."""

    name: str
    load: Callable[..., tuple[list[str] | None, Iterable]]
    argument: str | None  # the argument's form in help (`DIR`)
    help: str = ""
    splits: str | None = None  # (`train|val`); None: any name, a prefix only
    masks: bool = False
    arrays: bool = False
    flags: tuple[Flag, ...] = ()
    inputs: Callable[[str], list[Input]] | None = None

    @property
    def form(self) -> str:
        """`NAME:ARGUMENT`, or `NAME` for a source without argument."""
        return self.name if self.argument is None else f"{self.name}:{self.argument}"

    def described(self) -> str:
        """The source in `data convert`'s help: its form, flags, help and splits."""
        notes = "; ".join(part for part in (self.help, self.splits and f"--split {self.splits}") if part)
        flags = "".join(f" {flag.usage()}" for flag in self.flags)
        return f"{self.form}{flags}" + (f" ({notes})" if notes else "")


def _flags_free(kind: SourceKind) -> None:
    """Refuses a source whose flag is `data convert`'s own or another source's, in one line."""
    owners = {flag.name: other.form for other in SOURCES.values() for flag in other.flags}
    for flag in kind.flags:
        if flag.name in CONVERT_OPTIONS or flag.name in owners:
            owner = owners.get(flag.name, "data convert itself")
            raise BadValue(f"source {kind.name!r}: flag {flag.option} is taken ({owner}): name it otherwise")


# A source's name starts its samples' keys (`{name}-{split}-N`): lower case, as keys are.
SOURCES = Registry(
    "source",
    pattern=re.compile(r"[a-z][a-z0-9_]{0,63}"),
    rule="lower-case letters, digits and _",
    check=_flags_free,
)
# `register(SourceKind(...))`: importing the module that calls it is all a source needs
register = SOURCES.add


def source_flags() -> list[tuple[SourceKind, Flag]]:
    """Every source's own flags, with their source, in the order the sources were registered."""
    return [(kind, flag) for kind in SOURCES.values() for flag in kind.flags]


def sources_help() -> str:
    """SOURCE's help: every registered source, those with masks and those stored as arrays apart."""
    groups = (
        ("", [k for k in SOURCES.values() if not (k.masks or k.arrays)]),
        (
            "with segmentation masks (stored as each sample's seg.png): ",
            [k for k in SOURCES.values() if k.masks],
        ),
        (
            "of any band count and bit depth (stored as npy): ",
            [k for k in SOURCES.values() if k.arrays and not k.masks],
        ),
    )
    return "; ".join(title + ", ".join(k.described() for k in kinds) for title, kinds in groups if kinds)


def split_help() -> str:
    """`--split`'s help: what it selects for each source that has splits of its own."""
    by_splits: dict[str, list[str]] = {}
    for kind in SOURCES.values():
        if kind.splits:
            by_splits.setdefault(kind.splits, []).append(kind.name)
    chosen = ", ".join(f"{_listed(names)} ({splits})" for splits, names in by_splits.items())
    return "split name, a plain file-name prefix (letters, digits, - _ .)" + (
        f"; selects the split for {chosen}" if chosen else ""
    )


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def check_split(name: str, split: str, splits: tuple[str, ...]) -> None:
    """A loader's refusal, in one line, of a split its source `name` does not have."""
    if split not in splits:
        have = _listed([repr(s) for s in splits])
        raise UserError(f"{name} has splits {have}, not {split!r}: pass --split {'|'.join(splits)}")


def source_dir(name: str, arg: str) -> Path:
    """The folder `arg` of `name:DIR`; a loader's refusal, in one line, of one that is not there."""
    if not Path(arg).is_dir():
        raise UserError(f"{name}:{arg}: no such directory")
    return Path(arg)


def labelled_records(images: Iterable, labels, class_names=None) -> tuple[list[str], list]:
    """`(class names, records)` of an array source's images and their labels (None: unlabelled, no
    classes); the classes are `class_names`, by default "0" up to the largest label."""
    if labels is None:
        return [], [(image, -1) for image in images]
    names = class_names if class_names is not None else range(int(labels.max()) + 1)
    return [str(n) for n in names], [(image, int(label)) for image, label in zip(images, labels)]


def kind_of(spec: str) -> SourceKind:
    """The registered source a SOURCE string names; one line naming every source otherwise."""
    name, _, arg = spec.partition(":")
    kind = SOURCES.get(name)
    if kind is None:
        raise UserError(f"unknown source {spec!r}: use one of {sources_help()}")
    if kind.argument is None and arg:
        raise UserError(f"source {name!r} takes no argument (got {spec!r})")
    if kind.argument is not None and not arg:
        raise UserError(f"source {name!r} needs an argument ({kind.form}): use one of {sources_help()}")
    return kind


@dataclass
class Source:
    name: str  # the SOURCE string's kind, used in sample keys and the manifest
    spec: str  # the SOURCE string as given
    class_names: list[str] | None  # None: "0" ... "K-1" from the labels written (wds: without a manifest)
    records: Iterable  # of (payload, label[, mask]): see `ssl_vit.data.convert.payload`
    total: int | None  # the number of records, where known before reading them (progress, resume)
    masks: bool = False  # every record has a segmentation mask; `class_names` are its classes
    manifest: dict = field(default_factory=dict)  # more to record in the manifest, complete once the
    # records have been read to their end
    options: dict = field(default_factory=dict)  # the source's own options (a rerun with others starts over)


def open_source(spec: str, split: str, **options: Any) -> Source:
    """Parse a SOURCE string and load its records for `split`. `options` are the sources' own flags
    (`source_flags`), None where not given; each refused with any other source."""
    kind = kind_of(spec)
    own = {flag.name: options.get(flag.name) for flag in kind.flags}
    wrong = [name for name, value in options.items() if value is not None and name not in own]
    if wrong:
        owner = _owner(wrong[0])
        flags = ", ".join(flag.option for flag in owner.flags if flag.name in wrong)
        raise UserError(f"{flags}: only for the {owner.form} source, not {spec!r}: leave it out")
    for flag in kind.flags:
        if flag.required and own[flag.name] is None:
            raise UserError(f"{spec} needs {flag.option} {flag.metavar}: {flag.help}")
    class_names, records = kind.load(spec.partition(":")[2], split, **own)
    total = len(records) if isinstance(records, list) else records.total
    if total == 0:
        raise UserError(f"source {spec!r} has no images for split {split!r}")
    return Source(
        kind.name,
        spec,
        class_names,
        records,
        total,
        masks=kind.masks,
        manifest=getattr(records, "manifest", {}),  # what mosaic: and hf: record of themselves
        options=own,
    )


def _owner(option: str) -> SourceKind:
    """The source whose flag `option` is."""
    for kind in SOURCES.values():
        if any(flag.name == option for flag in kind.flags):
            return kind
    raise TypeError(f"open_source() got an unexpected keyword argument {option!r}")


def source_inputs(spec: str) -> list[Input]:
    """The local files and folders a SOURCE string reads, which OUTDIR must keep out of
    (`ssl_vit.storage.outdir`): as its source says, by default the paths of its argument split at commas."""
    kind = SOURCES.get(spec.partition(":")[0])
    arg = spec.partition(":")[2]
    if kind is None or kind.argument is None or not arg:
        return []
    if kind.inputs is not None:
        return kind.inputs(spec)
    return [Input(Path(part), f"the source {part}") for part in arg.split(",") if part]


def no_inputs(spec: str) -> list[Input]:
    """`inputs` of a source whose argument names no file (`synthetic:N`)."""
    return []


__all__ = [
    "Flag", "Source", "SourceKind", "SOURCES", "open_source", "register", "source_flags", "source_inputs",
    "sources_help", "split_help",
]  # fmt: skip
