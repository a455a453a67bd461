"""A mistake in a config, in a recipe file or on the command line, is one line `ssl-vit: error: KEY: WHAT`
naming the key, what is wrong and the closest valid key (class, choice) where there is one, exit status
2, nothing written: not jsonargparse's usage message and nested union report (77-86 lines for a typo).
Through the CLI, as users run it."""

from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from test_errors import listing

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes/quickstart/mpp.yaml")

# (a recipe of the test's own, or None; options; words the line holds, in order)
MISTAKES = {
    "unknown-option": (
        None,
        ["--data.init_args.batch_sise", "3"],
        ["--data.init_args.batch_sise: no such option of ssl_vit.data.ShardDataModule",
         "did you mean --data.init_args.batch_size?"],
    ),
    "unknown-key-in-recipe": (
        "data:\n  class_path: ssl_vit.data.ShardDataModule\n  init_args:\n    batch_sise: 3\n",
        [],
        ["data.init_args.batch_sise (in {recipe}): no such option",
         "did you mean data.init_args.batch_size?"],
    ),
    "unknown-trainer-key-in-recipe": (
        "trainer:\n  max_epohcs: 3\n",
        [],
        ["trainer.max_epohcs (in {recipe}): no such option", "did you mean trainer.max_epochs?"],
    ),
    "wrong-type-in-recipe": (
        'data:\n  init_args:\n    batch_size: "abc"\n',
        [],
        ["data.init_args.batch_size (in {recipe}): 'abc' is not an int"],
    ),
    "wrong-type-of-a-nested-option": (
        None,
        ["--model.init_args.training.optimizer.init_args.lr", "abc"],
        ["--model.init_args.training.optimizer.init_args.lr: 'abc' is not a float"],
    ),
    "unknown-choice": (
        None,
        ["--model.init_args.preset", "mea"],
        ["--model.init_args.preset: 'mea' is not one of vit_mpp, mae,", "did you mean mae?"],
    ),
    "unknown-class-path": (
        "model:\n  class_path: ssl_vit.tasks.MaskedPatchPretrainin\n",
        [],
        ["model.class_path (in {recipe}): ssl_vit.tasks has no class MaskedPatchPretrainin",
         "did you mean ssl_vit.tasks.MaskedPatchPretraining?"],
    ),
    "yaml-syntax": (
        "trainer:\n  max_epochs: [1\n  devices: 1\n",
        [],
        ["--config {recipe}: not YAML: line 3, column 10: expected ',' or ']'"],
    ),
    "missing-config": (None, ["--config", "nothere.yaml"], ["--config ", "nothere.yaml: no such file"]),
    "moved-option": (
        None,
        ["--data.init_args.crop_scale", "[0.2, 1.0]"],
        ["--data.init_args.crop_scale: moved to --data.init_args.augment.crop_scale"],
    ),
    "moved-key-in-recipe": (
        "data:\n  init_args:\n    shuffle_buffer: 10\n",
        [],
        ["data.init_args.shuffle_buffer (in {recipe}): moved to data.init_args.stream.shuffle_buffer"],
    ),
    "moved-task-option": (
        None,
        ["--model.init_args.init_from", "x.ckpt"],
        ["--model.init_args.init_from: moved to --model.init_args.training.init_from"],
    ),
    "option-inside-a-moved-one": (
        None,
        ["--model.init_args.optimizer.init_args.lr", "0.1"],
        ["--model.init_args.optimizer.init_args.lr: moved to",
         "--model.init_args.training.optimizer.init_args.lr"],
    ),
    "moved-task-key-in-recipe": (
        "model:\n  init_args:\n    lr_reference_batch: 256\n",
        [],
        ["model.init_args.lr_reference_batch (in {recipe}): moved to",
         "model.init_args.training.lr_reference_batch"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("recipe_text, options, words", MISTAKES.values(), ids=MISTAKES.keys())
def test_a_config_mistake_is_one_line_naming_the_key_and_the_closest_valid_one(
    tmp_path, recipe_text, options, words
):
    work = tmp_path / "work"
    work.mkdir()
    extra = []
    if recipe_text is not None:
        (work / "mine.yaml").write_text(recipe_text)
        extra = ["--config", "mine.yaml"]
    before = listing(tmp_path)
    proc = run_cli(
        "fit", "--config", RECIPE, *extra, *options, "--trainer.default_root_dir", str(tmp_path / "run"),
        cwd=work, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr
    assert lines[-1].startswith("ssl-vit: error: "), proc.stderr
    at = 0
    for word in words:
        at = lines[-1].index(word.format(recipe="mine.yaml"), at)  # each in its place, in order
    assert listing(tmp_path) == before  # no run directory, nothing written


def test_help_and_print_config_stay_as_they_are(tmp_path):
    helped = run_cli("fit", "--help", cwd=tmp_path)
    assert helped.stdout.startswith("usage: ssl-vit [options] fit") and "--data.help" in helped.stdout
    printed = run_cli("fit", "--config", RECIPE, "--data.init_args.batch_size", "3", "--print_config")
    assert "class_path: ssl_vit.tasks.MaskedPatchPretraining" in printed.stdout
    assert "batch_size: 3" in printed.stdout
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    "hparams, words",
    [({"mask_ratoi": 0.5}, "mask_ratoi: no such option of ssl_vit.tasks.MaskedPatchPretraining"),
     ({"mask_ratio": "abc"}, "model.init_args.mask_ratio: 'abc' is not a float")],
    ids=["unknown-key", "wrong-type"],
)  # fmt: skip
def test_a_checkpoint_whose_model_does_not_parse_is_one_line(tmp_path, hparams, words):
    """What LightningCLI rebuilds the model from: the checkpoint's hyperparameters, parsed over the config."""
    ckpt = tmp_path / "other.ckpt"
    hyper = {"_class_path": "ssl_vit.tasks.MaskedPatchPretraining", **hparams}
    torch.save(
        {"state_dict": {"backbone.w": torch.zeros(2)}, "global_step": 1, "hyper_parameters": hyper}, ckpt
    )
    before = listing(tmp_path)
    proc = run_cli("fit", "--config", RECIPE, "--ckpt_path", str(ckpt), "--trainer.default_root_dir",
                   str(tmp_path / "run"), cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line == (
        f"ssl-vit: error: --ckpt_path {ckpt}: the model its hyperparameters describe does not parse here "
        f"({words}); give a checkpoint this version of ssl-vit wrote"
    )
    assert listing(tmp_path) == before
