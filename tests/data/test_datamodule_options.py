"""`ShardDataModule`'s option groups (`ssl_vit.data.options`: `augment`, `stream`, `limits`): nested options
of LightningCLI, shown by `--print_config` and `--data.help` and set from the command line; the flat keys of
suites and of run configs written before the groups read through one mapping (`grouped`); an old flat key
in a recipe or on the command line is one line naming its new place (tests/test_config_errors.py)."""

import inspect
import shutil
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from cli_helpers import run_cli

from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import GROUPS, MOVED, Augment, Limits, Stream, grouped
from ssl_vit.errors import BadValue

ROOT = Path(__file__).resolve().parents[2]
SUPERVISED = str(ROOT / "recipes/quickstart/supervised.yaml")
OLD_RUN = ROOT / "tests/fixtures/before_refactor/supervised/config.yaml"  # flat keys, written before


def printed_data(proc) -> dict:
    return yaml.safe_load(proc.stdout)["data"]["init_args"]


def test_print_config_shows_the_groups_and_the_command_line_sets_a_grouped_option(tmp_path):
    proc = run_cli(
        "fit", "--config", SUPERVISED, "--data.init_args.augment.mixup_alpha", "0.2", "--print_config"
    )
    data = printed_data(proc)
    assert data["augment"] == {
        "train_preset": "supervised", "crop_scale": [0.6, 1.0], "randaugment": None, "mixup_alpha": 0.2,
        "cutmix_alpha": 0.0, "label_smoothing": 0.1, "eval_crop_pct": 0.875, "draft": True,
    }  # the recipe's, the command line's, the defaults'  # fmt: skip
    assert data["stream"] == {"shuffle_buffer": 2000, "segment_shards": 4, "on_data_change": "warn"}
    assert data["limits"]["read_retries"] == 5 and data["limits"]["loader_timeout_s"] is None
    assert not set(MOVED) & set(data)  # no grouped option left flat
    helped = run_cli("fit", "--data.help", "ssl_vit.data.ShardDataModule", cwd=tmp_path).stdout
    flat = " ".join(helped.split())
    assert "--data.augment.crop_scale" in flat and "area range of the random resized crop" in flat
    assert "--data.limits.read_timeout_s" in flat and "--data.stream.on_data_change" in flat


def test_a_runs_own_config_written_before_the_groups_is_read_with_them(tmp_path):
    """A run's config.yaml (the one in its own run directory, which `--ckpt_path last` resumes from and
    the resumed run writes anew) has the flat keys: they are read at their places. The same file
    anywhere else is a recipe, refused with the new place of its first old key."""
    run = tmp_path / "runs/before_refactor/supervised"
    run.mkdir(parents=True)
    shutil.copy(OLD_RUN, run / "config.yaml")
    # `--config=FILE` here, `--config FILE` in tests/test_before_refactor.py
    config = "runs/before_refactor/supervised/config.yaml"
    proc = run_cli("fit", f"--config={config}", "--print_config", cwd=tmp_path)
    data = printed_data(proc)
    (note,) = [line for line in proc.stderr.splitlines() if "options that moved" in line]
    # the model's moved options (`init_from -> training.init_from`, ...) are named first, then the data's
    assert (
        "runs/before_refactor/supervised/config.yaml: " in note
        and "train_preset -> augment.train_preset, " in note
    )
    assert "shuffle_buffer -> stream.shuffle_buffer" in note and "read_retries -> limits.read_retries" in note
    old = yaml.safe_load(OLD_RUN.read_text())["data"]["init_args"]
    for name, place in MOVED.items():
        group, key = place.split(".")
        assert data[group][key] == old.get(name, getattr(GROUPS[group](), key)), name
    assert data["augment"]["label_smoothing"] == 0.1 and data["augment"]["crop_scale"] == [0.6, 1.0]
    (tmp_path / "recipe").mkdir()
    shutil.copy(OLD_RUN, tmp_path / "recipe/config.yaml")
    proc = run_cli("fit", "--config", "recipe/config.yaml", "--print_config", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    # its first old key is the model's (the task options' group came after the data's)
    assert "(in recipe/config.yaml): moved to model.init_args.training." in proc.stderr


def test_flat_keys_map_onto_the_groups_in_one_place():
    args = grouped({"train_urls": "a.tar", "crop_scale": [0.2, 1.0], "eval_crop_pct": 1.0, "read_retries": 0})
    assert args == {
        "train_urls": "a.tar",
        "augment": Augment(crop_scale=(0.2, 1.0), eval_crop_pct=1.0),
        "limits": Limits(read_retries=0),
    }
    assert grouped({"batch_size": 4}) == {"batch_size": 4}  # no group given: the defaults'
    with pytest.raises(BadValue, match="shuffle_buffer and stream are both given: give stream alone"):
        grouped({"shuffle_buffer": 8, "stream": Stream()})
    # every option of every group has its flat name there, and none is still a flat option
    assert MOVED == {f.name: f"{g}.{f.name}" for g, cls in GROUPS.items() for f in fields(cls)}
    assert ShardDataModule.MOVED_OPTIONS is MOVED
    assert not set(MOVED) & set(inspect.signature(ShardDataModule).parameters)


@pytest.mark.parametrize(
    "group, words",
    [
        (lambda: Augment(crop_scale=(0.5, 0.2)), "crop_scale [0.5, 0.2]: give the random crop's area range"),
        (
            lambda: Augment(mixup_alpha=0.2),
            "mixup/cutmix belong to train_preset 'supervised', not 'pretrain'",
        ),
        (lambda: Stream(segment_shards=0), "segment_shards is 0: it should be an integer of at least 1"),
        (lambda: Stream(on_data_change="ignore"), "on_data_change must be 'warn' or 'refuse'"),
        (lambda: Limits(read_retries=-1), "read_retries is -1"),
        (lambda: Limits(loader_timeout_s=0), "loader_timeout_s is 0"),
        (lambda: Limits(max_image_pixels=0), "max_image_pixels is 0"),
    ],
)
def test_a_group_refuses_a_bad_value_in_one_line(group, words):
    with pytest.raises(BadValue, match=words.replace("[", r"\[").replace("]", r"\]")):
        group()
