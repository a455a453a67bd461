"""Every mistake a user can make on the command line ends as one line, `ssl-vit: error: WHAT: FIX`, a
non-zero exit, and nothing written: checked through the CLI, as users run it."""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import pytorch_lightning as pl
import timm
import torch
from cli_helpers import one_step_fit_args, run_cli
from safetensors.torch import save_file

from ssl_vit.checkpoints import config_metadata, load_backbone
from ssl_vit.checkpoints.store import check_ckpt_path, local_ckpt_path
from ssl_vit.data.format.manifest import check_manifest
from ssl_vit.errors import BadValue, UserError, user_error_message
from ssl_vit.models.vit import ViTConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}
# Lightning logs the seed (an info line) before any model is built; nothing else may be on stderr.
NOISE = re.compile(r"Seed set to \d+")


def error_line(proc, *words: str) -> str:
    """The one `ssl-vit: error:` line of a failed command, after checking that it is the only output
    on stderr (besides Lightning's seed line), that no traceback was shown and that it names `words`."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not NOISE.fullmatch(line)]
    assert len(lines) == 1 and lines[0].startswith("ssl-vit: error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def fit(shards: Path, workdir: Path, *extra: str, check: bool = False):
    """`ssl-vit fit` on the quickstart MPP recipe, one batch, run directory WORKDIR/run, cwd WORKDIR."""
    return run_cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        "--data.init_args.train_urls", str(shards / "train-{000000..000004}.tar"),
        "--data.init_args.val_urls", str(shards / "val-{000000..000003}.tar"),
        "--data.init_args.num_workers", "0",
        "--trainer.fast_dev_run", "1",
        "--trainer.default_root_dir", str(workdir / "run"),
        *extra,
        cwd=workdir, check=check,
    )  # fmt: skip


# --- fit ----------------------------------------------------------------------------------------------


def test_fit_with_an_unknown_variant(digits_shards, tmp_path):
    # Raised in the task's constructor, where jsonargparse wraps it in its own ValueError.
    proc = fit(digits_shards, tmp_path, "--model.init_args.backbone.variant", "X/16")
    error_line(proc, "unknown ViT variant 'X/16'", "SIZE one of Ti, S, M, B, L, H", "B/16")
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    "option, words",
    [
        (("--data.init_args.batch_size", "0"), ("batch_size is 0", "integer of at least 1")),
        (("--data.init_args.num_workers", "-2"), ("num_workers is -2", "integer of at least 0")),
        (("--data.init_args.train_batches", "0"), ("train_batches is 0", "integer of at least 1")),
        (("--data.init_args.augment.mixup_alpha", "0.8"), ("mixup/cutmix belong to train_preset",)),
        (("--data.init_args.augment.randaugment", "rand-m9"), ("randaugment is part of the 'supervised'",)),
        (("--data.init_args.stream.segment_shards", "0"), ("segment_shards is 0", "integer of at least 1")),
        (("--data.init_args.limits.read_timeout_s", "0"), ("read_timeout_s is 0", "a positive number")),
        (("--model.init_args.mask_ratio", "1.5"), ("mask_ratio must be in (0, 1)", "got 1.5")),
        (
            ("--model.init_args.training.optimizer.init_args.lr", "-1"),
            ("model.init_args.training.optimizer (AdamW): Invalid learning rate: -1.0", "give a valid value"),
        ),
        (("--checkpoint.every_n_train_steps", "-3"), ("every_n_train_steps=-3. Must be >= 0",)),
        (("--data.init_args.augment.crop_scale", "[1.5, 2.0]"), ("crop_scale [1.5, 2.0]", "0 < min <= max")),
        (("--data.init_args.image_size", "31"), ("image size 31 is not divisible by the patch size 4",)),
        (("--ckpt_path", "best"), ("--ckpt_path best", "monitors no metric", "give last")),
        (("--ckpt_path", ""), ("--ckpt_path is empty",)),
    ],
)
def test_fit_with_an_out_of_range_value(digits_shards, tmp_path, option, words):
    """Checked by the data module's and the task's constructors, before anything is written."""
    proc = fit(digits_shards, tmp_path, *option)
    error_line(proc, *words)
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    "option,words",
    [
        (("--trainer.accumulate_grad_batches", "2"), ("accumulate_grad_batches 2",)),
        (("--compile.backend", "aot_eager"), ("a setting of inductor", "--compile.backend aot_eager")),
        (("--trainer.strategy", "fsdp"), ("FSDP", "--trainer.strategy fsdp")),
        (
            ("--trainer.strategy", "pytorch_lightning.strategies.ModelParallelStrategy"),
            ("FSDP", "--trainer.strategy pytorch_lightning.strategies.ModelParallelStrategy"),
        ),
    ],
)
def test_fit_with_cuda_graphs_where_they_cannot_work(digits_shards, tmp_path, option, words):
    """Gradient accumulation (the replays would overwrite gradients), a backend other than inductor
    (whose settings the modes are) and FSDP (its hooks cannot be captured): refused before anything is
    built."""
    cuda_graphs = ("--compile.enabled", "true", "--compile.mode", "reduce-overhead")
    proc = fit(digits_shards, tmp_path, *cuda_graphs, *option)
    error_line(proc, "--compile.mode reduce-overhead", *words, "--compile.mode default")
    assert listing(tmp_path) == []


def not_torch_zip(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("notes.txt", "a zip, but not one torch wrote")


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: p.write_bytes(bytes(range(256)) * 4), "not a checkpoint torch can load safely"),
        (lambda p: p.write_text("epoch: 3\nloss: 0.1\n"), "not a checkpoint torch can load safely"),
        (not_torch_zip, "not a checkpoint torch can load safely"),
        (lambda p: torch.save({"weight": torch.zeros(2)}, p), "not a Lightning checkpoint (no state_dict)"),
        (lambda p: p.mkdir(), "is not a file"),
        (lambda p: None, "does not exist"),
    ],
    ids=["random-bytes", "text", "zip-not-torch", "torch-not-lightning", "directory", "missing"],
)
def test_fit_ckpt_path_that_is_not_a_checkpoint(digits_shards, tmp_path, make, words):
    ckpt = tmp_path / "given" / "weights.ckpt"
    ckpt.parent.mkdir()
    make(ckpt)
    before = listing(tmp_path)
    for arg in (["--ckpt_path", str(ckpt)], [f"--ckpt_path={ckpt}"]):
        proc = fit(digits_shards, tmp_path, *arg)
        line = error_line(proc, f"--ckpt_path {ckpt}", words, "RUN/checkpoints/last.ckpt", "init_from")
        assert listing(tmp_path) == before  # no run directory, no wandb files
    assert line.startswith("ssl-vit: error: ") and "\n" not in line


def test_fit_ckpt_path_with_no_weights(digits_shards, tmp_path):
    ckpt = tmp_path / "empty.ckpt"
    torch.save({"state_dict": {}, "global_step": 0}, ckpt)
    proc = fit(digits_shards, tmp_path, "--ckpt_path", str(ckpt))
    error_line(proc, f"--ckpt_path {ckpt} holds no weights (its state_dict is empty)")
    assert listing(tmp_path) == ["empty.ckpt"]


def test_resume_over_a_dangling_last_link_is_one_line(digits_shards, tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").symlink_to("step0000004.ckpt")  # the file it named was deleted
    before = listing(tmp_path)
    proc = fit(digits_shards, tmp_path, "--ckpt_path", "last")
    error_line(proc, "last.ckpt is damaged (a link to step0000004.ckpt, which does not exist)")
    assert listing(tmp_path) == before


@pytest.mark.parametrize("command", ["validate", "test"])
def test_validate_or_test_without_a_checkpoint_is_refused_unless_scratch_is_named(
    digits_shards, tmp_path, command
):
    args = [
        command, "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        "--data.init_args.val_urls", str(digits_shards / "val-000000.tar"),
        "--data.init_args.test_urls", str(digits_shards / "val-000000.tar"),
        "--data.init_args.num_workers", "0", "--trainer.logger", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    proc = run_cli(*args, cwd=tmp_path, check=False)
    error_line(proc, f"{command} needs --ckpt_path", "randomly initialised model", "scratch")
    assert listing(tmp_path) == []
    proc = run_cli(*args, "--ckpt_path", "scratch", cwd=tmp_path)  # on purpose: the initialisation
    assert proc.returncode == 0 and ("val/" in proc.stdout or "test/" in proc.stdout), proc.stdout[-2000:]


def test_check_ckpt_path_accepts_a_lightning_checkpoint(tmp_path):
    from ssl_vit.tasks import MaskedPatchPretraining

    model = MaskedPatchPretraining(ViTConfig(**TINY), preset="vit_mpp")
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    check_ckpt_path(tmp_path / "last.ckpt")
    with pytest.raises(UserError, match="does not exist"):
        check_ckpt_path(tmp_path / "nope.ckpt")


def test_local_ckpt_path_skips_keywords_and_urls():
    assert local_ckpt_path("a.ckpt") == "a.ckpt"
    for value in ("last", "best", "hpc", "null", "registry", "registry:model:v1", "s3://b/a.ckpt", None, ""):
        assert local_ckpt_path(value) is None, value


def broken_copy(shards: Path, into: Path, split: str, edit) -> Path:
    """A copy of the digits split SPLIT whose manifest went through `edit(manifest)`."""
    into.mkdir()
    for shard in shards.glob(f"{split}-*.tar"):
        (into / shard.name).write_bytes(shard.read_bytes())
    manifest = json.loads((shards / f"{split}.json").read_text())
    text = edit(manifest)
    (into / f"{split}.json").write_text(text if isinstance(text, str) else json.dumps(manifest))
    return into


@pytest.mark.slow
@pytest.mark.parametrize(
    "key, value",
    [("num_samples", "40"), ("num_classes", 10.5)],
)
def test_fit_on_shards_whose_manifest_has_wrong_types(digits_shards, tmp_path, key, value):
    shards = broken_copy(digits_shards, tmp_path / "shards", "train", lambda m: m.__setitem__(key, value))
    for name in ("val-000000.tar", "val-000001.tar", "val-000002.tar", "val-000003.tar", "val.json"):
        (shards / name).write_bytes((digits_shards / name).read_bytes())
    before = listing(tmp_path)
    proc = fit(shards, tmp_path)
    error_line(proc, f"manifest {shards / 'train.json'}: {key!r} is {value!r}", "non-negative integer")
    assert listing(tmp_path) == before


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: m.__setitem__("num_samples", "40"), "'num_samples' is '40', it should be a non-negative"),
        (lambda m: m.__setitem__("shards", {"url": "val-000000.tar"}), "'shards' is {'url'"),
        (
            lambda m: m["shards"][1].pop("num_samples"),
            "'shards'[1] is {'url': 'val-000001.tar'}, it should be",
        ),
        (
            lambda m: m["class_counts"].__setitem__("3", "40"),
            "'class_counts'['3'] is '40', it should be a non-",
        ),
        (lambda m: "{not json", "is not JSON"),
    ],
    ids=["num_samples-str", "shards-not-list", "shard-without-count", "class_count-str", "not-json"],
)
def test_inspect_shards_whose_manifest_is_broken(digits_shards, tmp_path, edit, words):
    shards = broken_copy(digits_shards, tmp_path / "shards", "val", edit)
    proc = run_cli("data", "inspect", str(shards / "val-{000000..000003}.tar"), check=False)
    line = error_line(proc, f"manifest {shards / 'val.json'}", words)  # exit 2, one line, no traceback
    assert line.startswith("ssl-vit: error: manifest") and proc.stdout.strip() == ""  # no report printed


def test_check_manifest_names_the_key_and_the_type(digits_shards):
    good = json.loads((digits_shards / "val.json").read_text())
    check_manifest(good, "val.json")
    for key, value in [
        ("num_samples", -1),
        ("num_samples", True),
        ("num_classes", "10"),
        ("num_classes", None),
        ("class_names", "0123456789"),
        ("class_counts", [28, 38]),
        ("class_counts", {"three": 1}),
        ("shards", [{"url": 3, "num_samples": 100}]),
        ("image_size", [32]),
        ("version", "1"),
    ]:
        with pytest.raises(
            UserError, match=rf"^manifest val\.json: '{key}'(\[.+\])? is .*: fix the file or re-run"
        ):
            check_manifest({**good, key: value}, "val.json")
    with pytest.raises(UserError, match="'shards' is missing"):
        check_manifest({k: v for k, v in good.items() if k != "shards"}, "val.json")
    with pytest.raises(UserError, match="a JSON list, not an object"):
        check_manifest([good], "val.json")


def test_labels_beyond_num_classes(digits_shards, tmp_path):
    proc = fit(digits_shards, tmp_path, "--data.init_args.num_classes", "5")
    error_line(proc, "counts labels up to 9, beyond num_classes 5", "data.init_args.num_classes to at least")
    assert listing(tmp_path) == []


# `--trainer.logger false`: the CLI's default LearningRateMonitor raised MisconfigurationException
# ("Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger.") at the start of
# training; without a logger it is left out.
@pytest.mark.slow
def test_fit_without_a_logger_runs(digits_shards, tmp_path):
    proc = fit(digits_shards, tmp_path, "--trainer.logger", "false", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ssl-vit: error" not in proc.stderr
    assert not (tmp_path / "run" / "wandb").exists()


# --- evaluate -------------------------------------------------------------------------------------------


def write_suite(path: Path, shards: Path, **changes) -> Path:
    suite = {
        "backbone": dict(TINY),
        "data": {
            "train_urls": str(shards / "train-{000000..000004}.tar"),
            "test_urls": str(shards / "val-{000000..000003}.tar"),
            "image_size": 32,
            "num_workers": 0,
        },
        "protocols": [{"name": "knn", "kind": "knn", "k": 5}],
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            suite[section][field] = value
        else:
            suite[section] = value
    path.write_text(json.dumps(suite))  # JSON is YAML
    return path


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"backbone__variant": "X/16"}, ["backbone: unknown ViT variant 'X/16'", "SIZE one of Ti, S"]),
        (
            {"data__shuffle": True},
            ["data: unknown keys ['shuffle']", "valid keys are train_urls, val_urls, test_urls"],
        ),
        ({"protocol": []}, ["unknown keys ['protocol']", "valid keys are backbone, data, datasets"]),
        ({"backbone__patch": 8}, ["backbone: unknown keys ['patch']", "valid keys are variant, img_size"]),
        ({"seed": "zero"}, ["seed is 'zero'", "integer"]),
        (
            {"protocols": [{"name": "knn", "kind": "knn", "k": 5000}]},
            ["protocol 'knn': k 5000 is more than the", "training images it votes among"],
        ),
    ],
    ids=["variant", "data-key", "top-level-key", "backbone-key", "seed", "k"],
)
def test_evaluate_with_a_bad_suite(digits_shards, tmp_path, changes, words):
    suite = write_suite(tmp_path / "suite.yaml", digits_shards, **changes)
    proc = run_cli("evaluate", "scratch", "--suite", str(suite), "--out", str(tmp_path / "out"), check=False)
    error_line(proc, str(suite), *words)
    assert not (tmp_path / "out").exists()


def safetensors_with(path: Path, metadata: dict | None) -> Path:
    state = {k: v.contiguous() for k, v in ViTConfig(**TINY).build().state_dict().items()}
    save_file(state, path, metadata=metadata)
    return path


GOOD_METADATA = json.loads(config_metadata(ViTConfig(**TINY))["ssl_vit.backbone"])


@pytest.mark.parametrize(
    "make, words",
    [
        (
            lambda p: safetensors_with(p, {"ssl_vit.backbone": "{variant: S/8"}),
            ["metadata 'ssl_vit.backbone' is not JSON", "re-export"],
        ),
        (
            lambda p: safetensors_with(
                p, {"ssl_vit.backbone": json.dumps({**GOOD_METADATA, "variant": "X/16"})}
            ),
            ["metadata 'ssl_vit.backbone': unknown ViT variant 'X/16'", "SIZE one of"],
        ),
        (
            lambda p: safetensors_with(p, {"ssl_vit.backbone": json.dumps({**GOOD_METADATA, "colour": 1})}),
            ["metadata 'ssl_vit.backbone': unknown keys ['colour']", "valid keys are variant"],
        ),
        (
            lambda p: safetensors_with(p, {"ssl_vit.backbone": json.dumps({**GOOD_METADATA, "depth": "1"})}),
            ["metadata 'ssl_vit.backbone': depth is '1'", "positive integer"],
        ),
        (lambda p: p.write_bytes(bytes(range(256)) * 4), ["not a checkpoint torch can load safely"]),
        (lambda p: p.write_text("epoch: 3\n"), ["not a checkpoint torch can load safely"]),
        (not_torch_zip, ["not a checkpoint torch can load safely"]),
        (
            lambda p: torch.save(timm.create_model("resnet18").state_dict(), p),
            ["is not a ViT's weights", "it holds 122 others (conv1.weight, bn1.weight, bn1.bias, ...)"],
        ),
    ],
    ids=["meta-not-json", "meta-variant", "meta-unknown-key", "meta-type", "random", "text", "zip", "resnet"],
)
def test_evaluate_a_file_that_is_not_a_usable_checkpoint(digits_shards, tmp_path, make, words):
    suffix = ".safetensors" if "meta" in words[0] else ".pth" if "ViT" in words[0] else ".ckpt"
    name = f"weights{suffix}"
    ckpt = tmp_path / name
    make(ckpt)
    suite = write_suite(tmp_path / "suite.yaml", digits_shards)
    proc = run_cli("evaluate", str(ckpt), "--suite", str(suite), "--out", str(tmp_path / "out"), check=False)
    line = error_line(proc, str(ckpt), *words)
    assert len(line) - len(str(ckpt)) < 250  # what is wrong, not every key of it
    assert not (tmp_path / "out").exists()


# --- how main() finds the UserError behind what libraries raise ------------------------------------------


class _Failing(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise UserError("shard x.tar is unreadable: re-run `ssl-vit data convert`")


def test_a_dataloader_workers_user_error_is_its_last_line():
    loader = torch.utils.data.DataLoader(_Failing(), num_workers=1)
    with pytest.raises(UserError) as info:  # torch re-raises the worker's type, traceback in the message
        next(iter(loader))
    assert "Original Traceback" in str(info.value)
    assert user_error_message(info.value) == "shard x.tar is unreadable: re-run `ssl-vit data convert`"


def test_wrapped_user_errors_are_found_and_others_are_not():
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    try:
        try:
            raise BadValue("unknown ViT variant 'Q/16': give SIZE/PATCH")
        except ValueError as err:
            raise MisconfigurationException("setup failed") from err
    except MisconfigurationException as err:
        assert user_error_message(err) == "unknown ViT variant 'Q/16': give SIZE/PATCH"

    # jsonargparse's Union errors paste the message into their own, without the exception object.
    UserError("width 7 is not divisible by heads 2: pick heads that divide it")
    pasted = ValueError(
        "Does not validate against any of the Union subtypes\nErrors:\n"
        "  - width 7 is not divisible by heads 2: pick heads that divide it\nGiven value type: Namespace"
    )
    assert user_error_message(pasted) == "width 7 is not divisible by heads 2: pick heads that divide it"

    assert user_error_message(KeyError(101)) is None
    worker = "Caught KeyError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
    assert user_error_message(RuntimeError(worker + "KeyError: 3")) is None


# --- the run directory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["fit", "validate", "test"])
@pytest.mark.parametrize("under", [False, True], ids=["the-file", "under-the-file"])
def test_a_run_directory_that_is_a_file_is_one_line(digits_shards, tmp_path, command, under):
    given = tmp_path / "notes.txt"
    given.write_text("not a directory\n")
    root = given / "run" if under else given
    if command == "fit":
        args = one_step_fit_args(digits_shards, root)
    else:
        args = [
            command, "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
            "--data.init_args.val_urls", str(digits_shards / "val-000000.tar"),
            "--data.init_args.test_urls", str(digits_shards / "val-000000.tar"),
            "--data.init_args.num_workers", "0", "--trainer.default_root_dir", str(root),
            "--ckpt_path", "scratch",
        ]  # fmt: skip
    proc = run_cli(*args, cwd=tmp_path, check=False)
    where = "is a file" if not under else f"lies under the file {given}"
    error_line(proc, f"--trainer.default_root_dir {root} {where}: give a directory")
    assert proc.stdout == ""
    assert listing(tmp_path) == ["notes.txt"] and given.read_text() == "not a directory\n"


# --- timm:NAME without the network --------------------------------------------------------------------------

# The Hub at a port where nothing listens; the Hugging Face settings of the caller's environment left out,
# so that the cache is the test's own, empty one.
NO_HUB = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_evaluate_timm_weights_without_the_hub_is_one_line_at_once(digits_shards, tmp_path, verbose):
    """Not cached and no Hub to ask: one line, without the Hub client's retries (5 per file, backing off
    1 to 8 s, about 45 s in all), which `--verbose` would show. A process of its own, not the CLI fork
    server: huggingface_hub reads its settings from the environment when it is imported."""
    suite = write_suite(tmp_path / "suite.yaml", digits_shards)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(NO_HUB, HF_HOME=str(tmp_path / "hf"))
    cmd = [
        sys.executable, "-m", "ssl_vit", "evaluate", "timm:vit_tiny_patch16_224",
        "--suite", str(suite), "--out", str(tmp_path / "out"), *(["--verbose"] if verbose else []),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    words = ["timm:vit_tiny_patch16_224: its weights are not in the Hugging Face cache", "cannot be reached"]
    if verbose:  # everything shows, and there is nothing but the error to show
        assert "Retrying in" not in proc.stderr and "thrown while requesting" not in proc.stderr, proc.stderr
        assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith("ssl-vit: error: timm:")
    else:
        error_line(proc, *words, "(http://127.0.0.1:9)", "export the weights to a .safetensors file")
    assert proc.stdout == ""
    assert listing(tmp_path) == ["suite.yaml"]  # no --out, nothing in the Hugging Face cache


def test_timm_weights_in_the_cache_load_without_the_hub(tmp_path, monkeypatch):
    """The counterpart: cached weights need no Hub (the cache is read first)."""
    from huggingface_hub import constants

    source = timm.create_model("vit_tiny_patch16_224", num_classes=0)
    repo = tmp_path / "hub" / "models--timm--vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # timm's default tag
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    weights = {k: v.contiguous() for k, v in source.state_dict().items()}
    save_file(weights, repo / "snapshots" / commit / "model.safetensors")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", NO_HUB["HF_ENDPOINT"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    vit, config = load_backbone("timm:vit_tiny_patch16_224")
    assert config == ViTConfig("Ti/16", 224)
    images = torch.randn(1, 3, 224, 224)
    source.eval(), vit.eval()
    torch.testing.assert_close(vit(images), source(images))
