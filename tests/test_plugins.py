"""Plugins: a preset, a target, a feature, a protocol kind and `data convert` sources (one with a payload
of its own) defined outside the package (a module the test writes into its own folder, named by
SSL_VIT_PLUGINS, or an installed package's entry point) work through the CLI wherever the built-in ones
do; a plugin that does not import is one line naming it."""

import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pydantic
import pytest
import torch
import webdataset as wds
import yaml
from cli_helpers import one_step_fit_args, run_cli, wandb_records
from test_errors import error_line

from ssl_vit.errors import BadValue
from ssl_vit.presets import PRESETS, Preset
from ssl_vit.registry import Registry
from ssl_vit.targets import TARGETS
from ssl_vit.tasks import MaskedPatchPretraining
from ssl_vit.tasks.base import Training

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
"""A plugin of the test's own: a target, a preset that predicts it, a feature, a protocol kind and two
sources."""

import dataclasses
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic.dataclasses import dataclass

from ssl_vit.data.convert.encode import encode_image
from ssl_vit.data.convert.source import Flag, SourceKind, no_inputs, register as register_source
from ssl_vit.errors import UserError
from ssl_vit.evaluation.protocol import STRICT, Outcome, Protocol, register as register_kind
from ssl_vit.evaluation.scoring import restrict
from ssl_vit.evaluation.stats import Score
from ssl_vit.models.feature import Feature, register as register_feature
from ssl_vit.presets import Preset, register as register_preset
from ssl_vit.targets import Target, register as register_target
from ssl_vit.targets.patches import patchify


@register_target
class PatchStd(Target):
    """Each band's standard deviation over each patch's pixels: C values per patch."""

    NAME = "patch_std"

    def shape(self, ctx):
        return torch.Size([ctx.bands])

    def make(self, ctx, images):
        patches = patchify(ctx.pixels(images), ctx.patch_size)  # (B, N, p*p*C)
        return patches.unflatten(-1, (-1, ctx.bands)).std(dim=-2)  # (B, N, C)


register_preset(Preset("texture", corruption="mask_token", target="patch_std", mask_ratio=0.5,
                       pixel_loss="l1"))
# each image's patch tokens' maximum, per channel: (B, N, D) -> (B, D)
register_feature(Feature("max_patches", "patch tokens' maximum", lambda read: read.tokens.patches.amax(1)))


@register_kind
@dataclass(config=STRICT)
class CentroidProtocol(Protocol):
    """Each test image's class: the nearest mean of the training images' features (cosine)."""

    KIND: ClassVar[str] = "centroid"
    TITLE: ClassVar[str] = "nearest centroid"

    def run(self, features, config, seed, where):
        train = restrict(features.get("train", self.feature), self.classes)
        test = restrict(features.get("test", self.feature), self.classes)
        classes = train.y.unique()
        x = F.normalize(train.x.float(), dim=1)
        means = F.normalize(torch.stack([x[train.y == c].mean(0) for c in classes]), dim=1)
        nearest = classes[(F.normalize(test.x.float(), dim=1) @ means.T).argmax(1)]
        detail = {"classes": len(classes), "test_samples": len(test.y)}
        return Outcome({self.name: Score.of_correct((nearest == test.y)[None])}, {self.name: detail})


def stripes(arg, split, period):
    """N grey (16, 16) images: black and white stripes `period` pixels wide, from white (class 0) or
    black (class 1) on the left, in turn."""
    period = 2 if period is None else period
    if period < 1:
        raise UserError(f"--period {period}: give a stripe width of at least 1 pixel")
    band = (np.arange(16) // period) % 2  # (16,)
    images = [np.repeat(((band + c + 1) % 2 * 255).astype(np.uint8)[None], 16, axis=0) for c in (0, 1)]
    return ["white_first", "black_first"], [(images[i % 2], i % 2) for i in range(int(arg))]


register_source(SourceKind(
    "stripes", stripes, "N", "N 16x16 images of vertical stripes", splits="train|val",
    flags=(Flag("period", "stripe width in pixels (default 2)", type=int, metavar="P"),), inputs=no_inputs,
))


@dataclasses.dataclass(frozen=True)
class Chequer:
    """A payload of the plugin's own: a grey (16, 16) chequerboard of `cell`-pixel squares, drawn by the
    writer's workers."""

    cell: int
    where: str

    def encode(self, options, mask):
        if self.cell < 1:
            raise ValueError(f"cells of {self.cell} pixels cannot be drawn")
        cells = np.arange(16) // self.cell  # (16,)
        return encode_image(((cells[:, None] + cells) % 2 * 255).astype(np.uint8), options)


def chequers(arg, split):
    """N chequerboards of 4-pixel (class 0) and 8-pixel (class 1) cells in turn, then one of 0-pixel cells."""
    records = [(Chequer(4 + 4 * (i % 2), f"chequer {i}"), i % 2) for i in range(int(arg))]
    return ["small", "large"], records + [(Chequer(0, f"chequer {arg}"), 0)]


register_source(SourceKind("chequers", chequers, "N", "N 16x16 chequerboards, drawn as they are written",
                           inputs=no_inputs))  # fmt: skip
'''


@pytest.fixture
def plugin(tmp_path) -> dict[str, str]:
    """The environment of a command that loads the test's plugin, `my_plugin.py` in a folder of its own."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "my_plugin.py").write_text(PLUGIN)
    return {"PYTHONPATH": str(folder), "SSL_VIT_PLUGINS": "my_plugin"}


@pytest.mark.slow
def test_a_plugin_preset_and_target_fit_and_its_kind_evaluates(plugin, digits_shards, tmp_path):
    """`fit` with the plugin's preset trains on the plugin's target (C = 3 outputs per patch, L1), 2 steps;
    `evaluate` of its checkpoint runs a suite of the plugin's kind."""
    run = tmp_path / "run"
    args = one_step_fit_args(
        digits_shards, run, "--model.init_args.preset", "texture", "--data.init_args.train_batches", "2",
        "--trainer.log_every_n_steps", "1", config="mae",
    )  # fmt: skip
    run_cli(*args, cwd=ROOT, env=plugin)
    ckpt = run / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["preset"] == "texture"
    assert saved["hyper_parameters"]["target"] == "patch_std"
    assert saved["hyper_parameters"]["pixel_loss"] == "l1"
    assert saved["state_dict"]["head.proj.weight"].shape[0] == 3  # the plugin's shape: one value per band
    [(_, records)] = wandb_records(run)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    assert len(losses) == 2 and all(map(math.isfinite, losses)), losses

    # The quickstart's suite (its backbone is the quickstart recipe's), on 2 + 2 shards, of the plugin's kind
    suite = yaml.safe_load((ROOT / "recipes/eval/quickstart.yaml").read_text())
    suite["data"].update(
        train_urls=str(digits_shards / "train-{000000..000001}.tar"),
        test_urls=str(digits_shards / "val-{000000..000001}.tar"),
        num_workers=0,
    )
    suite["protocols"] = [{"name": "nearest", "kind": "centroid", "feature": "mean"}]
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    run_cli("evaluate", str(ckpt), "--suite", "suite.yaml", "--out", str(out), cwd=tmp_path, env=plugin)
    record = json.loads((out / "results.json").read_text())
    assert list(record["results"]) == ["nearest"]
    assert 0.1 < record["results"]["nearest"] <= 1  # above chance on the ten digits
    assert record["details"]["nearest"] == {"classes": 10, "test_samples": 200}

    # Without the plugin, the checkpoint's preset is not a valid name: one line, nothing run.
    proc = run_cli(
        "validate", "--config", str(ROOT / "recipes/quickstart/mae.yaml"), "--ckpt_path", str(ckpt),
        "--trainer.default_root_dir", str(tmp_path / "validate"), cwd=ROOT, check=False,
    )  # fmt: skip
    error_line(
        proc,
        f"--ckpt_path {ckpt}: the model its hyperparameters describe does not parse",
        "preset: 'texture' is not one of",
    )
    assert not (tmp_path / "validate").exists()


def test_a_plugin_feature_is_read_by_a_suite_and_taken_by_the_linear_probe(plugin, digits_shards, tmp_path):
    """The plugin's feature, which no `Literal` fixed when the package was imported could hold: a suite's
    protocol reads it through `evaluate`, and the linear probe's
    `--model.init_args.feature` takes it, listed among the valid ones when a name is not."""
    suite = yaml.safe_load((ROOT / "recipes/eval/quickstart.yaml").read_text())
    suite["data"].update(
        train_urls=str(digits_shards / "train-{000000..000001}.tar"),
        test_urls=str(digits_shards / "val-{000000..000001}.tar"),
        num_workers=0,
    )
    suite["protocols"] = [{"name": "knn", "kind": "knn", "feature": "max_patches", "k": 5}]
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    run_cli("evaluate", "scratch", "--suite", "suite.yaml", "--out", str(out), cwd=tmp_path, env=plugin)
    record = json.loads((out / "results.json").read_text())
    assert list(record["results"]) == ["knn"] and 0.1 < record["results"]["knn"] <= 1  # above chance
    assert record["protocols"][0]["feature"] == "max_patches"

    recipe = str(ROOT / "recipes/quickstart/linear_probe.yaml")
    option = "--model.init_args.feature"
    printed = run_cli("fit", "--config", recipe, option, "max_patches", "--print_config", env=plugin)
    assert "feature: max_patches" in printed.stdout
    proc = run_cli("fit", "--config", recipe, option, "max_patch", cwd=tmp_path, env=plugin, check=False)
    error_line(proc, f"{option}: 'max_patch' is not one of ", "max_patches; did you mean max_patches?")
    proc = run_cli("fit", "--config", recipe, option, "max_patches", cwd=tmp_path, check=False)
    error_line(proc, f"{option}: 'max_patches' is not one of cls, mean")


def test_a_plugin_source_converts_with_its_own_flag(plugin, tmp_path):
    """`ssl-vit data convert stripes:N OUT --period P` with the plugin loaded: shards and a manifest of
    the plugin's images; the source and its flag are in the command's help; its flag is refused with
    another source, and the source is unknown without the plugin, each in one line."""
    out = tmp_path / "shards"
    run_cli("data", "convert", "stripes:5", str(out), "--period", "4", "--no-progress", env=plugin)
    manifest = json.loads((out / "train.json").read_text())
    assert manifest["source"] == "stripes:5" and manifest["class_names"] == ["white_first", "black_first"]
    assert manifest["num_samples"] == 5 and manifest["class_counts"] == {"0": 3, "1": 2}
    samples = list(wds.WebDataset(str(out / "train-000000.tar"), shardshuffle=False).decode("l"))
    assert [int(s["cls"]) for s in samples] == [0, 1, 0, 1, 0]
    first = (np.asarray(samples[0]["png"]) * 255).round()  # (16, 16) in [0, 1] as decoded
    assert first[:, :4].min() == 255 and first[:, 4:8].max() == 0 and first[:, 8:12].min() == 255

    helped = " ".join(run_cli("data", "convert", "--help", env=plugin).stdout.split())
    assert "stripes:N [--period P] (N 16x16 images of vertical stripes; --split train|val)" in helped
    assert "--period P" in helped and "stripe width in pixels (default 2)" in helped
    proc = run_cli("data", "convert", "stripes:2", str(tmp_path / "bad"), "--period", "0", env=plugin,
                   check=False)  # fmt: skip
    error_line(proc, "--period 0: give a stripe width of at least 1 pixel")
    proc = run_cli("data", "convert", "synthetic:2", str(tmp_path / "other"), "--period", "4", env=plugin,
                   check=False)  # fmt: skip
    error_line(proc, "--period: only for the stripes:N source, not 'synthetic:2': leave it out")
    proc = run_cli("data", "convert", "stripes:2", str(tmp_path / "none"), check=False)
    error_line(proc, "unknown source 'stripes:2': use one of ")
    assert not any((tmp_path / name).exists() for name in ("bad", "other", "none"))


def test_a_plugin_payload_is_encoded_by_its_own_class(plugin, tmp_path):
    """`ssl-vit data convert chequers:4 --workers 2`: the plugin's records carry a payload class the
    writer does not know; the workers encode each through it, so the shard holds the boards its `encode`
    drew, and the record it refuses is skipped in one line naming its `where`."""
    out = tmp_path / "shards"
    proc = run_cli("data", "convert", "chequers:4", str(out), "--workers", "2", "--order", "source",
                   "--no-progress", env=plugin)  # fmt: skip
    assert "skipping unreadable image chequer 4: cells of 0 pixels cannot be drawn" in proc.stderr
    manifest = json.loads((out / "train.json").read_text())
    assert manifest["num_samples"] == 4 and manifest["skipped"] == 1
    assert manifest["class_counts"] == {"0": 2, "1": 2} and manifest["image_size"] == [16, 16]
    samples = list(wds.WebDataset(str(out / "train-000000.tar"), shardshuffle=False).decode("l"))
    assert [int(s["cls"]) for s in samples] == [0, 1, 0, 1]
    for sample in samples:
        cells = np.arange(16) // (4 + 4 * int(sample["cls"]))
        drawn = (cells[:, None] + cells) % 2 * 255
        assert np.array_equal((np.asarray(sample["png"]) * 255).round(), drawn)  # decoded in [0, 1]


def test_a_plugin_name_is_a_valid_choice_and_listed_where_the_built_in_ones_are(plugin, tmp_path):
    recipe = str(ROOT / "recipes/quickstart/mae.yaml")
    printed = run_cli(
        "fit", "--config", recipe, "--model.init_args.preset", "texture", "--print_config", env=plugin
    )
    assert "preset: texture" in printed.stdout
    proc = run_cli(
        "fit", "--config", recipe, "--model.init_args.preset", "textur", cwd=tmp_path, env=plugin, check=False
    )
    error_line(
        proc,
        "--model.init_args.preset: 'textur' is not one of vit_mpp, mae, simmim, maskfeat, ijepa, data2vec2, "
        "texture; did you mean texture?"
    )  # fmt: skip
    helped = run_cli("fit", "--model.help", "MaskedPatchPretraining", env=plugin).stdout
    for option, words in (("preset", "a registered preset's name"), ("target", "a registered target's name")):
        assert f"--model.{option} {option.upper()}" in helped and words in " ".join(helped.split())
    helped = run_cli("bench", "step", "--help", env=plugin)
    assert "data2vec2,texture}" in "".join(helped.stdout.split())  # the bench's tasks: every preset
    assert run_cli("bench", "step", "--help").stdout.count("texture") == 0


def test_an_installed_plugin_is_found_by_its_entry_point(tmp_path):
    """What `pip install` leaves for a package that declares `[project.entry-points."ssl_vit.plugins"]`:
    its module, and an entry_points.txt in its .dist-info, here on PYTHONPATH."""
    (tmp_path / "their_plugin.py").write_text(
        "from ssl_vit.presets import Preset, register\nregister(Preset('their_mae', corruption='drop', "
        "target='pixels', mask_ratio=0.5))\n"
    )
    info = tmp_path / "their_package-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: their-package\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ssl_vit.plugins]\ntheirs = their_plugin\n")
    helped = run_cli("bench", "parts", "--help", env={"PYTHONPATH": str(tmp_path)})
    assert "their_mae" in helped.stdout


@pytest.mark.parametrize(
    "source, words",
    [
        ("", ["plugin missing_plugin (named in SSL_VIT_PLUGINS) does not import: ModuleNotFoundError: No "
              "module named 'missing_plugin'", "put it on the Python path (PYTHONPATH)"]),
        ("raise RuntimeError('no licence key')\n",
         ["plugin missing_plugin (named in SSL_VIT_PLUGINS) does not import: RuntimeError: no licence key"]),
        ("from ssl_vit.presets import Preset, register\nregister(Preset('mae', target='pixels'))\n",
         ["plugin missing_plugin", "BadValue: preset 'mae' is registered twice (by ", "missing_plugin",
          "give one of them another"]),
    ],
    ids=["missing", "raises", "name-taken"],
)  # fmt: skip
def test_a_plugin_that_does_not_import_is_one_line_naming_it(tmp_path, source, words):
    if source:
        (tmp_path / "missing_plugin.py").write_text(source)
    env = {"PYTHONPATH": str(tmp_path), "SSL_VIT_PLUGINS": " missing_plugin,"}
    error_line(run_cli("info", cwd=tmp_path, env=env, check=False), *words)


def test_a_plugin_kind_named_like_a_built_in_one_is_one_line_naming_both(tmp_path):
    """The plugin registers first (the built-in kinds are imported when a suite is read): the second
    registration, the built-in one, is refused, naming both modules; nothing is written."""
    (tmp_path / "my_kinds.py").write_text(
        "from typing import ClassVar\n"
        "from pydantic.dataclasses import dataclass\n"
        "from ssl_vit.evaluation.protocol import STRICT, Protocol, register\n"
        "@register\n@dataclass(config=STRICT)\nclass Mine(Protocol):\n    KIND: ClassVar[str] = 'knn'\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "SSL_VIT_PLUGINS": "my_kinds"}
    suite, out = ROOT / "recipes/eval/quickstart.yaml", tmp_path / "out"
    proc = run_cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out), env=env, check=False)
    error_line(
        proc,
        "protocol kind 'knn' is registered twice (by my_kinds and ssl_vit.evaluation.kinds.knn_protocol)",
    )
    assert not out.exists()


def test_a_registry_names_the_valid_ones_and_refuses_a_name_twice():
    colours = Registry("colour")
    colours.add(Colour("red", True))
    green = colours.add(Colour("green", False))
    assert colours.pick("green") is green and colours.names(warm=True) == ("red",)
    with pytest.raises(BadValue, match=r"^unknown colour 'blue': use one of red, green$"):
        colours.pick("blue")
    with pytest.raises(BadValue, match=r"^unknown colour 'green': use one of red$"):
        colours.pick("green", among=("red",))
    with pytest.raises(
        BadValue, match=rf"^colour 'red' is registered twice \(by {__name__} and {__name__}\): give"
    ):
        colours.add(Colour("red", False))
    with pytest.raises(BadValue, match=r"^colour name 'a b': give one of letters, digits"):
        colours.add(Colour("a b", True))

    @pydantic.dataclasses.dataclass
    class Paint:
        colour: colours.choice("WarmColour", warm=True)

    assert Paint("red").colour == "red" and type(Paint("red").colour) is str
    with pytest.raises(pydantic.ValidationError, match="Input should be 'red'"):
        Paint("green")
    colours.add(Colour("orange", True))  # the names as they are when a value is checked
    assert Paint("orange").colour == "orange" and colours.choice("WarmColour", warm=True).valid() == (
        "red",
        "orange",
    )


def test_a_preset_that_sets_what_the_task_does_not_take_is_one_line():
    PRESETS.add(Preset("old_style", corruption="drop", target="pixels", mask_ratio=0.5, decoder="big"))
    try:
        with pytest.raises(
            BadValue, match=r"preset 'old_style' sets decoder, which MaskedPatchPretraining does"
        ):
            MaskedPatchPretraining(_tiny(), preset="old_style")
    finally:
        del PRESETS["old_style"]


def test_every_target_predicts_its_shape_for_every_band_count_it_takes(digits_batch):
    """Each registered target's `make` gives (B, N, *shape) on RGB and on five bands where it takes them;
    the ones it refuses are refused in one line naming it."""
    images = digits_batch["image"][:2]
    for name, target in TARGETS.items():
        for bands in (3, 5):
            x = images if bands == 3 else torch.cat([images, images[:, :2]], dim=1)
            kwargs = dict(
                target=name, corruption="mask_token", mask_ratio=0.5,
                training=Training(mean=(0.5,) * bands, std=(0.2,) * bands),
            )  # fmt: skip
            if not target.accepts(bands):
                with pytest.raises(
                    BadValue, match=f"target '{name}' {target.REFUSES}, and the data has {bands}"
                ):
                    MaskedPatchPretraining(_tiny(bands), **kwargs)
                continue
            task = MaskedPatchPretraining(_tiny(bands), **kwargs)
            made = task.target.make(task.context, x)
            shape = task.target_shape
            expected = (2, 16, *shape) if made.dtype != torch.long else (2, 16, *shape[:-1])
            assert tuple(made.shape) == expected, name


class Colour(NamedTuple):
    name: str
    warm: bool


def _tiny(bands: int = 3):
    from ssl_vit.models.vit import ViTConfig

    return ViTConfig("S/8", 32, width=32, depth=2, heads=2, in_chans=bands)


@pytest.mark.parametrize("source", ["import time\ntime.sleep(600)\n", "raise RuntimeError('broken')\n"],
                         ids=["never-finishes", "raises"])  # fmt: skip
def test_the_list_of_commands_loads_no_plugin(tmp_path, source):
    """Issue 42: a plugin that never finished importing hung even `ssl-vit --help`. Plugins add names
    within commands, never commands: the list of commands is shown without them."""
    (tmp_path / "slow_plugin.py").write_text(source)
    env = {"PYTHONPATH": str(tmp_path), "SSL_VIT_PLUGINS": "slow_plugin"}
    proc = run_cli("--help", cwd=tmp_path, env=env, timeout=60)
    assert "status" in proc.stdout and "evaluate" in proc.stdout and not proc.stderr
