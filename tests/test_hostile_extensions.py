"""What a hostile or mistaken user gives the extension points (plugins, their names and targets) and the
data module's option groups (`augment`, `stream`, `limits`, and the old flat keys of a run's own
config.yaml): one line `ssl-vit: error: ...`, exit status 2, nothing written; never a traceback, a
silent exit or a value quietly chosen."""

import contextlib
import io
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from cli_helpers import one_step_fit_args, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from test_errors import error_line

from ssl_vit import plugins
from ssl_vit.cli.moved_options import _move_options
from ssl_vit.data.options import GROUPS, MOVED, Augment, check_groups
from ssl_vit.data.transforms.rgb import build_transform
from ssl_vit.errors import BadValue, UserError
from ssl_vit.registry import NAME, Registry

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "before_refactor"
RECIPE = str(ROOT / "recipes/quickstart/mae.yaml")
REGISTER = "from ssl_vit.presets import Preset, register\nregister(Preset({!r}, target='pixels'))\n"


# --- plugins ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, words",
    [
        ("raise SystemExit(3)\n", ["plugin hostile (named in SSL_VIT_PLUGINS) does not import: SystemExit: "
                                   "3: fix it or take it out of SSL_VIT_PLUGINS"]),
        ("import sys\nsys.exit('no licence')\n", ["does not import: SystemExit: no licence: fix it"]),
        ("def broken(:\n", ["plugin hostile", "SyntaxError: invalid syntax (hostile.py, line 1): fix it"]),
        ("raise RuntimeError('')\n", ["does not import: RuntimeError: fix it or take it out"]),
        (REGISTER.format("my:mae"), ["BadValue: preset name 'my:mae': give one of letters, digits"]),
        (REGISTER.format("my mae"), ["BadValue: preset name 'my mae': give one of letters, digits"]),
        (REGISTER.format("-mae"), ["BadValue: preset name '-mae'"]),
    ],
    ids=["exit-code", "exit-message", "syntax", "empty-message", "colon", "space", "dash"],
)  # fmt: skip
def test_a_plugin_that_exits_or_names_badly_is_one_line_naming_it(tmp_path, source, words):
    """A plugin's `sys.exit()` ended every command, with its status and no word (or its message alone);
    a name with ':' or a space was taken, and could never be written as `SOURCE` or in a list."""
    (tmp_path / "hostile.py").write_text(source)
    env = {"PYTHONPATH": str(tmp_path), "SSL_VIT_PLUGINS": "hostile"}
    error_line(run_cli("info", cwd=tmp_path, env=env, check=False), *words)
    error_line(run_cli("fit", "--help", cwd=tmp_path, env=env, check=False), *words)


@pytest.mark.parametrize("group", ["ssl_vit.plugins", "console_scripts"])
def test_an_installed_package_whose_entry_points_do_not_read_is_named(tmp_path, group):
    """importlib reads every package's entry_points.txt to find the plugins: one with a line that is not
    `name = value`, in any group, was a traceback of every command."""
    info = tmp_path / "broken_pkg-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-pkg\nVersion: 2.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\njust a line\n")
    proc = run_cli("info", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, check=False)
    error_line(proc, "the entry points of installed package broken-pkg 2.0 do not read (", "reinstall or")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(alphabet=" ,.:-_/*\té\\xz0", max_size=8), max_size=4))
def test_any_plugin_list_loads_or_is_one_line(names):
    """SSL_VIT_PLUGINS of hostile text (separators, dots, colons, slashes; no real module can be named):
    every name either is skipped as empty or stops the command with one line naming it."""
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(plugins.ENV, ",".join(names))
            plugins.load()
    except UserError as err:
        assert "\n" not in str(err) and str(err).startswith("plugin ") and plugins.ENV in str(err), err
    else:
        assert not any(name.strip() for name in ",".join(names).split(","))


@settings(max_examples=50, deadline=None)
@given(st.one_of(st.text(max_size=80), st.integers(), st.none()))
def test_a_registry_takes_a_name_it_can_write_or_refuses_it_in_one_line(name):
    things = Registry("thing")
    try:
        things.add(SimpleNamespace(name=name))
    except BadValue as err:
        assert "\n" not in str(err) and len(str(err)) < 200, err
        assert not isinstance(name, str) or not NAME.fullmatch(name), err
    else:
        assert NAME.fullmatch(name) and things.pick(name) is not None
        assert not set(name) & set(" \t\n:,/")


def test_a_plugin_preset_of_a_target_never_registered_names_the_preset(digits_shards, tmp_path):
    """The line said `target must be one of ... (or set a preset), got 'nosuch'`, where a preset was set:
    the plugin's, whose target no module registered."""
    (tmp_path / "ghost.py").write_text(
        "from ssl_vit.presets import Preset, register\nregister(Preset('ghost', target='nosuch', "
        "corruption='drop', mask_ratio=0.5))\n"
    )
    run = tmp_path / "run"
    args = one_step_fit_args(digits_shards, run, "--model.init_args.preset", "ghost", config="mae")
    proc = run_cli(
        *args, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "SSL_VIT_PLUGINS": "ghost"}, check=False
    )
    error_line(proc, "target must be one of color3bit, ", "(set by preset 'ghost'), got 'nosuch'")
    assert not run.exists()


@pytest.mark.parametrize(
    "choice, value, valid",
    [("encoder_init", "jax", ("timm", "mae")), ("head_init", "zeros", ("xavier", "torch"))],
)
def test_a_start_that_is_none_of_the_choices_is_one_line(digits_shards, tmp_path, choice, value, valid):
    run = tmp_path / "run"
    args = one_step_fit_args(digits_shards, run, f"--model.init_args.{choice}", value, config="mae")
    proc = run_cli(*args, cwd=tmp_path, check=False)
    error_line(proc, choice, repr(value))
    assert all(name in proc.stderr for name in valid) and not run.exists()


# --- a plugin target's shapes ---------------------------------------------------------------------------

TARGET = """
import torch
from ssl_vit.targets import Target, register

@register
class Hostile(Target):
    NAME = "hostile"

    def shape(self, ctx):
        return {shape}

    def make(self, ctx, images):
        return {made}
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, made, words",
    [
        ("(0,)", "None", ["target 'hostile' (hostile_target): shape() gave (0,): give a torch.Size of"]),
        ("[3]", "None", ["target 'hostile' (hostile_target): shape() gave [3]: give a torch.Size"]),
        ("torch.Size([ctx.bands])", "images.mean()",
         ["target 'hostile' (hostile_target): make() gave a torch.float32 tensor of shape (), not",
          "(64, 64, 3)", "fix its make()"]),
    ],
    ids=["zero", "list", "scalar"],
)  # fmt: skip
def test_a_plugin_target_of_the_wrong_shape_is_one_line(digits_shards, tmp_path, shape, made, words):
    """A target whose shape() is not sizes failed in the head's layers, one whose make() gives another
    shape in the loss's gather: tracebacks, the second after the run directory was made."""
    (tmp_path / "hostile_target.py").write_text(TARGET.format(shape=shape, made=made))
    env = {"PYTHONPATH": str(tmp_path), "SSL_VIT_PLUGINS": "hostile_target"}
    run = tmp_path / "run"
    args = one_step_fit_args(
        digits_shards, run, "--model.init_args.target", "hostile", "--trainer.logger", "false", config="mae"
    )
    error_line(run_cli(*args, cwd=tmp_path, env=env, check=False), *words)
    assert not run.exists()


# --- the data module's option groups ------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("augment", "null", ["augment: None is not a group of options: give its keys as a mapping "
                             "(augment: {train_preset: ...}) or leave it out"]),
        ("limits", "[1, 2]", ["limits: [1, 2] is not a group of options"]),
        ("stream", "[]", ["stream: [] is not a group of options"]),
        ("augment", "supervised", ["--data.init_args.augment: 'supervised' is not a group of options nor a "
                                   "file of them: give its keys (--data.init_args.augment.KEY VALUE"]),
    ],
)  # fmt: skip
def test_a_group_given_other_than_its_options_is_one_line(tmp_path, option, value, words):
    """`--data.init_args.augment null` (or a list) was taken by the parser and failed in a traceback
    when the data module was built; a word was a line naming jsonargparse's `NestedArg(...)`."""
    run = tmp_path / "run"
    args = [
        "fit",
        "--config",
        RECIPE,
        f"--data.init_args.{option}",
        value,
        "--trainer.default_root_dir",
        str(run),
    ]
    error_line(run_cli(*args, cwd=tmp_path, check=False), *words)
    assert not run.exists()


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("stream.shuffle_buffer", "-1", ["shuffle_buffer is -1: it should be an integer of at least 0"]),
        ("augment.eval_crop_pct", "0", ["eval_crop_pct 0.0: give a number above 0 (1: the whole image"]),
        ("augment.eval_crop_pct", "-1.5", ["eval_crop_pct -1.5: give a number above 0"]),
        ("augment.label_smoothing", "2", ["label_smoothing 2.0: give a number in [0, 1)"]),
        ("augment.mixup_alpha", "-1", ["mixup_alpha -1.0: give a number at least 0 (0: off)"]),
        ("augment.cutmix_alpha", "-0.5", ["cutmix_alpha -0.5: give a number at least 0"]),
    ],
)  # fmt: skip
def test_a_group_number_out_of_its_range_is_one_line(digits_shards, tmp_path, option, value, words):
    """Each trained: a negative shuffle buffer without a shuffle (webdataset's buffer never fills), the
    others until the first validation (eval_crop_pct 0 divides by it) or on negative soft targets."""
    run = tmp_path / "run"
    args = one_step_fit_args(digits_shards, run, f"--data.init_args.{option}", value)
    error_line(run_cli(*args, cwd=tmp_path, check=False), *words)
    assert not run.exists()


@pytest.mark.parametrize(
    "value, words",
    [
        ("nonsense", ["randaugment 'nonsense': not a timm RandAugment config (it does not start with"]),
        ("rand-m9.5", ["randaugment 'rand-m9.5': not a timm RandAugment config (invalid literal for int()"]),
        ("rand-foo5", ["(Unknown RandAugment config section): give one such as rand-m9-mstd0.5-inc1"]),
    ],
)  # fmt: skip
def test_a_randaugment_timm_does_not_parse_is_one_line(digits_shards, tmp_path, value, words):
    """timm's parser asserts (or fails on a section's number): a traceback as the data module was built."""
    run = tmp_path / "run"
    args = one_step_fit_args(
        digits_shards, run, "--data.init_args.augment.randaugment", value, config="supervised"
    )
    error_line(run_cli(*args, cwd=tmp_path, check=False), *words)
    assert not run.exists()


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="rand-mstdincw0159._x", max_size=20))
def test_any_randaugment_text_builds_or_is_one_line(config):
    try:
        transform = build_transform("supervised", 16, mean=(0.5,) * 3, randaugment=config)
    except BadValue as err:
        assert "\n" not in str(err) and "not a timm RandAugment config" in str(err), err
    else:
        assert callable(transform)


@pytest.mark.parametrize(
    "recipe, words",
    [
        ("augment: {mixup_alfa: 0.1}", ["data.init_args.augment.mixup_alfa (in mine.yaml): no such option of "
                                        "ssl_vit.data.ShardDataModule; did you mean data.init_args.augment."
                                        "mixup_alpha?"]),
        ("augment: {crop_scale: [0.2]}", ["data.init_args.augment.crop_scale (in mine.yaml): [0.2] is not 2 "
                                          "values: give a list of 2"]),
        ("crop_scale: [0.2, 1.0]", ["data.init_args.crop_scale (in mine.yaml): moved to "
                                    "data.init_args.augment.crop_scale"]),
    ],
    ids=["typo", "length", "flat"],
)  # fmt: skip
def test_a_group_key_wrong_in_a_recipe_is_one_line_naming_it(tmp_path, recipe, words):
    """A misspelt key inside a recipe's group, or a crop_scale of one value, was a line quoting the whole
    `data` block as "not a value it takes"."""
    (tmp_path / "mine.yaml").write_text(f"data:\n  init_args:\n    {recipe}\n")
    proc = run_cli(
        "fit", "--config", RECIPE, "--config", "mine.yaml", "--print_config", cwd=tmp_path, check=False
    )
    error_line(proc, *words)


@settings(max_examples=50, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["mixup_alpha", "cutmix_alpha", "label_smoothing", "eval_crop_pct"]),
        st.floats(allow_nan=True, allow_infinity=True),
        min_size=1,
    )
)
def test_any_augment_numbers_build_or_are_one_line(numbers):
    try:
        augment = Augment(train_preset="supervised", **numbers)
    except BadValue as err:
        assert "\n" not in str(err) and "give a number" in str(err), err
    else:
        assert augment.mixup_alpha >= 0 and augment.cutmix_alpha >= 0 and 0 <= augment.label_smoothing < 1
        assert 0 < augment.eval_crop_pct < math.inf


@pytest.mark.parametrize(
    "text, got",
    [("[1, 2]\n", "a list"), ("hello\n", "a str"), ("", "nothing")],
    ids=["list", "word", "empty"],
)
def test_a_config_that_is_not_a_mapping_is_one_line_naming_it(tmp_path, text, got):
    """It was `Unexpected config: [1, 2]`, naming neither the file nor the fix."""
    (tmp_path / "bad.yaml").write_text(text)
    proc = run_cli(
        "fit", "--config", RECIPE, "--config", "bad.yaml", "--print_config", cwd=tmp_path, check=False
    )
    error_line(proc, f"--config bad.yaml: holds {got}, not a mapping of options: give KEY: VALUE lines")


def _old_run(tmp_path: Path, **data) -> Path:
    """The before-refactor MPP run in its own directory, its data init_args updated with `data`."""
    run = tmp_path / "runs/before_refactor/mpp"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(FIXTURES / "mpp/last.ckpt", run / "checkpoints")
    tree = yaml.safe_load((FIXTURES / "mpp/config.yaml").read_text())
    tree["data"]["init_args"].update(data)
    (run / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    return run / "config.yaml"


@pytest.mark.parametrize(
    "data, words",
    [
        ({"augment": {"crop_scale": [0.3, 1.0]}},
         ["crop_scale ([0.6, 1.0]) and augment.crop_scale ([0.3, 1.0]) are both given: keep "
          "augment.crop_scale and take crop_scale out"]),
        ({"augment": "pretrain"}, ["augment is 'pretrain', beside train_preset: give augment as a mapping"]),
    ],
    ids=["both", "word"],
)  # fmt: skip
def test_an_old_run_config_with_an_old_key_and_its_new_place_is_one_line(tmp_path, data, words):
    """Both given with different values: the old one won, silently; a group of a word beside the old
    keys was a traceback. The file and the run are left as they were."""
    config = _old_run(tmp_path, **data)
    before = config.read_text()
    proc = run_cli("fit", "--config", str(config.relative_to(tmp_path)), "--ckpt_path", "last", cwd=tmp_path,
                   check=False)  # fmt: skip
    error_line(proc, "runs/before_refactor/mpp/config.yaml: ", *words)
    assert config.read_text() == before
    assert sorted(p.name for p in config.parent.iterdir()) == ["checkpoints", "config.yaml"]


def test_an_old_key_beside_its_new_place_with_the_same_value_is_read_once(tmp_path):
    config = _old_run(tmp_path, augment={"crop_scale": [0.6, 1.0]})
    printed = run_cli("fit", "--config", str(config), "--print_config", cwd=tmp_path).stdout
    augment = yaml.safe_load(printed)["data"]["init_args"]["augment"]
    assert augment["crop_scale"] == [0.6, 1.0] and augment["train_preset"] == "pretrain"


# Config trees as a hand-edited or damaged run config.yaml holds them: the data module's class, its init
# args of old flat keys, groups and other keys, each of any value (no other class_path: it is imported).
_VALUES = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2))
_KEYS = st.sampled_from([*MOVED, *GROUPS, "batch_size", "init_args"])
_ARGS = st.dictionaries(_KEYS, st.one_of(_VALUES, st.dictionaries(_KEYS, _VALUES, max_size=3)), max_size=6)


@settings(max_examples=50, deadline=None)
@given(_ARGS)
def test_any_old_run_config_moves_or_is_one_line(init_args):
    tree = {"data": {"class_path": "ssl_vit.data.ShardDataModule", "init_args": init_args}}
    flat = {key: value for key, value in init_args.items() if key in MOVED}
    try:
        moved = _move_options(tree, "config.yaml")
    except UserError as err:
        assert "\n" not in str(err) and str(err).startswith("config.yaml: "), err
        return
    assert sorted(old for old, _ in moved) == sorted(flat)
    for old, new in moved:
        group, name = new.split(".")
        assert tree["data"]["init_args"][group][name] == flat[old] and old not in tree["data"]["init_args"]


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.sampled_from([*GROUPS, "batch_size"]), _VALUES, max_size=3))
def test_any_group_value_is_options_or_one_line(args):
    try:
        check_groups(args)
    except BadValue as err:
        assert "\n" not in str(err) and "is not a group of options" in str(err), err
    else:
        assert not set(GROUPS) & set(args)  # none of the values drawn is a group's options


# Each example parses a whole fit command line (about a second): 12 of this small alphabet's keys
@settings(max_examples=12, deadline=None)
@given(st.text(alphabet="abcxyz_.-:[]{}'\" =,", min_size=1, max_size=12))
def test_any_group_key_on_the_command_line_is_one_line(key):
    """`--data.init_args.augment.KEY 1` for hostile KEYs (dots, brackets, quotes, '='): the fit CLI says
    one `ssl-vit: error:` line and exits 2, whatever jsonargparse makes of the key."""
    from ssl_vit.cli import main

    argv = ["fit", "--config", RECIPE, f"--data.init_args.augment.{key}", "1", "--print_config"]
    stderr, stdout = io.StringIO(), io.StringIO()
    # sys.argv as the command's own: LightningCLI warns of arguments beside another command line
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stderr(stderr),
        contextlib.redirect_stdout(stdout),
    ):
        patch.setattr(sys, "argv", ["ssl-vit", *argv])
        status = main(argv)
    lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("ssl-vit: error: "), stderr.getvalue()
    assert not stdout.getvalue()
