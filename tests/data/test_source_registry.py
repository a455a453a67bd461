"""The `data convert` sources as a registry (`ssl_vit.data.convert.source.register`): a source registered from
outside the package, with a flag of its own, converts like a built-in one; the command's help, flags and
checks are derived from what every source registered."""

import contextlib
import io
import json
import re

import numpy as np
import pytest
import webdataset as wds

from ssl_vit.cli import main
from ssl_vit.data.convert import source
from ssl_vit.data.convert.source import SOURCES, Flag, SourceKind, register, sources_help, split_help


@pytest.fixture
def registry():
    """The registry, restored to what the package left in it after the test (a registration is global)."""
    before = dict(SOURCES)
    yield SOURCES
    SOURCES.clear()
    SOURCES.update(before)


def register_solid(name: str = "solid") -> None:
    """A tiny source: N 4x4 images of one grey level (`--level`, default 7), labels 0, 1, 0, ..."""

    def load(arg: str, split: str, level: int | None) -> tuple[list[str], list]:
        image = np.full((4, 4), 7 if level is None else level, dtype=np.uint8)
        return ["even", "odd"], [(image, i % 2) for i in range(int(arg))]

    flags = (Flag("level", "the squares' grey level", type=int, metavar="G"),)
    help = "N solid grey squares"
    register(SourceKind(name, load, "N", help, splits="train|val", flags=flags, inputs=source.no_inputs))


def cli(*argv: str) -> tuple[int, str, str]:
    """`ssl-vit ARGV` in this process (where the test's registration is): exit status, stdout, stderr."""
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            status = main(list(argv))
        except SystemExit as stop:  # argparse's --help
            status = stop.code
    return status, out.getvalue(), err.getvalue()


def test_a_source_registered_outside_the_package_converts_with_its_own_flag(registry, tmp_path):
    register_solid()
    status, out, err = cli(
        "data", "convert", "solid:5", str(tmp_path / "out"), "--level", "200", "--no-progress"
    )
    assert status == 0 and "wrote 5 samples" in out, err
    manifest = json.loads((tmp_path / "out" / "train.json").read_text())
    assert manifest["source"] == "solid:5" and manifest["class_names"] == ["even", "odd"]
    assert manifest["class_counts"] == {"0": 3, "1": 2}
    urls = [str(tmp_path / "out" / shard["url"]) for shard in manifest["shards"]]
    samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode("l8"))
    assert [s["__key__"] for s in samples] == [f"solid-train-{i:08d}" for i in range(5)]
    assert all((np.asarray(s["png"]) == 200).all() for s in samples)


def test_a_registered_sources_flag_is_its_own(registry, tmp_path):
    register_solid()
    out = tmp_path / "out"
    status, _, err = cli("data", "convert", "synthetic:3", str(out), "--level", "3")  # another source's
    assert status == 2 and not out.exists()
    assert err == "ssl-vit: error: --level: only for the solid:N source, not 'synthetic:3': leave it out\n"
    status, _, err = cli("data", "convert", "solid:3", str(out), "--grid", "2")  # and mosaic's is not its
    assert status == 2 and not out.exists()
    assert err == "ssl-vit: error: --grid: only for the mosaic:URLS source, not 'solid:3': leave it out\n"


def test_the_help_and_flags_are_derived_from_the_registry(registry):
    register_solid()
    status, shown, _ = cli("data", "convert", "--help")
    assert status == 0
    flat = " ".join(shown.split())  # argparse wraps the help
    for kind in registry.values():
        assert kind.described() in sources_help()
        for flag in kind.flags:
            assert f"{flag.option} {flag.metavar}" in flat and f"{kind.form} only: " in flat, flag
    assert "solid:N [--level G] (N solid grey squares; --split train|val)" in flat
    # grouped with the sources of the same splits, in the order they were registered
    assert "selects the split for digits, imagenet, ade20k and solid (train|val), cifar10" in split_help()
    assert split_help() in flat
    masks = [k.name for k in registry.values() if k.masks]
    arrays = [k.name for k in registry.values() if k.arrays]
    assert masks == ["ade20k", "voc", "mosaic"] and arrays == ["tiff", "eurosat"]
    assert f"Sources with segmentation masks ({', '.join(masks)})" in flat
    assert f"array sources ({', '.join(arrays)})" in flat


def test_a_required_flag_is_refused_missing_in_one_line(tmp_path):
    spec = f"mosaic:{tmp_path}/tiles/train-000000.tar"
    status, _, err = cli("data", "convert", spec, str(tmp_path / "out"))
    assert status == 2 and err.startswith(f"ssl-vit: error: {spec} needs --grid K: K x K tiles per image")
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "flag", "why"),
    [
        ("digits", None, "source 'digits' is registered twice (by ssl_vit.data.convert.digits and "),
        ("Bad-Name", None, "source name 'Bad-Name': give one of lower-case letters, digits and _"),
        ("fresh", "grid", "taken (mosaic:URLS)"),
        ("fresh", "shard_size", "taken (data convert itself)"),
    ],
)
def test_register_refuses_a_name_or_flag_that_is_taken(registry, name, flag, why):
    flags = (Flag(flag, "x"),) if flag else ()
    before = set(registry)
    with pytest.raises(ValueError, match=re.escape(why)):
        register(SourceKind(name, lambda arg, split: ([], []), "DIR", flags=flags))
    assert set(registry) == before
