"""The checks of a fit's (or validate's, test's) run directory and `--ckpt_path`, made before Lightning
reads either and before anything is written, each a one-line UserError naming the problem and the fix:

- the run directory (`--trainer.default_root_dir`): not a file, and for a fresh start not one that holds
  an earlier run's checkpoints, which it would overwrite (its lock, `ssl_vit.storage.lock`, keeps a second fit
  out);
- `--ckpt_path`: a choice Lightning would refuse from deep inside (`best`, empty, none for validate/test),
  and `last` resolved to the newest intact checkpoint (the file itself is checked by
  `ssl_vit.checkpoints.store`);
- the model the checkpoint records against the config: options this version takes, the data's bands,
  and no model value of the config or the command line that it would silently replace.

The fit CLI (`ssl_vit.cli.fit`) calls them; they read a config as jsonargparse's Namespace gives it.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

import yaml

from ssl_vit.checkpoints.store import resumable, unparsable_model
from ssl_vit.errors import UserError

DEFAULT_ROOT = "runs/default"  # the run directory without --trainer.default_root_dir


# --- the run directory ----------------------------------------------------------------------------------


def follow_run_dir(config, argv: list[str]) -> str | None:
    """A run directory's own `config.yaml` given as `--config` where the directory now is (copied or
    moved: runs move between scratch and project filesystems): the checkpoint folder it derived from its
    run directory (`RUN/checkpoints`, written out absolute or relative) is derived again from the run
    directory of this command, and without `--trainer.default_root_dir` on the command line the run
    directory is the one the file lies in, not the one it names; a logger's `save_dir` that was the run
    directory (W&B's folder and run id) follows it too. So a copy resumes from its own checkpoints and
    never writes into the original's. Changes `config`; returns the warning line to
    print when the run directory was followed, else None."""
    note = None
    for path in map(Path, config_files(argv)):
        recorded = _recorded(path)
        root = recorded.get("trainer", {}).get("default_root_dir")
        dirpath = recorded.get("checkpoint", {}).get("dirpath")
        if path.name != "config.yaml" or not isinstance(root, str):  # a run directory's own config only
            continue
        if (
            isinstance(dirpath, str)
            and _same(dirpath, Path(root) / "checkpoints")
            and config.checkpoint.dirpath == dirpath  # not given again on the command line
        ):
            config.checkpoint.dirpath = None  # derived again (`checkpoint_dir`)
        for spec in _loggers(config):  # a logger that wrote into the run directory (W&B) goes on doing so
            save_dir = getattr(spec.init_args, "save_dir", None)
            if isinstance(save_dir, str) and _same(save_dir, root):
                spec.init_args.save_dir = None  # derived again (`SslVitCLI.before_instantiate_classes`)
        here = path.parent
        given = any(
            a == "--trainer.default_root_dir" or a.startswith("--trainer.default_root_dir=") for a in argv
        )
        moved = not _same(root, here) and (here / "checkpoints").is_dir()
        if not given and moved and config.trainer.default_root_dir == root:
            config.trainer.default_root_dir = str(here)
            note = (
                f"{path} names the run directory {root}, but lies in {here}: the run in {here} is run (give "
                "--trainer.default_root_dir to choose another)"
            )
    return note


def _loggers(config) -> list:
    """The logger specs of `config` that have constructor arguments (`class_path` + `init_args`)."""
    logger = config.trainer.logger
    specs = logger if isinstance(logger, list) else [logger]
    return [spec for spec in specs if getattr(spec, "init_args", None) is not None]


# Values that must agree between data and model, given once on the data side: the config links each
# into the backbone (a data module without `channels` reads RGB: the backbone keeps in_chans 3).
DATA_TO_MODEL = {
    "data.init_args.image_size": "model.init_args.backbone.img_size",
    "data.init_args.channels": "model.init_args.backbone.in_chans",
}


def refuse_contradicting_links(config, argv: list[str]) -> None:
    """A backbone value of `DATA_TO_MODEL` given (on the command line or in a `--config` file) that is
    not the data's: one line. The link would drop the value given without a word and build a model of
    the data's size or band count."""
    for source, target in DATA_TO_MODEL.items():
        data_value = config.get(source)  # jsonargparse reads dotted keys; None where a part is missing
        if not isinstance(data_value, int):
            continue
        for given, where in _given(argv, target):
            if str(given).strip() != str(data_value):
                name = source.rsplit(".", 1)[1]
                raise UserError(
                    f"--{target} {given}{where} contradicts the data's {name} ({data_value}): the backbone "
                    f"takes the data's {name}; give --{source} instead, or leave "
                    f"{target.rsplit('.', 1)[1]} out"
                )


def _given(argv: list[str], dotted: str) -> list[tuple[object, str]]:
    """Each value `argv` gives the option `dotted`, with where (` (in FILE)` for a config file)."""
    option = f"--{dotted}"
    found = [(value, "") for arg, value in zip(argv, [*argv[1:], ""]) if arg == option]
    found += [(arg.partition("=")[2], "") for arg in argv if arg.startswith(f"{option}=")]
    for path in map(Path, config_files(argv)):
        value: object = _load(path)
        for key in dotted.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            found.append((value, f" (in {path})"))
    return found


def config_files(argv: list[str]) -> list[str]:
    """The files given as `--config FILE` / `-c FILE` / `--config=FILE`, in order."""
    files = []
    for arg, value in zip(argv, [*argv[1:], ""]):
        if arg in ("--config", "-c"):
            files.append(value)
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def _recorded(path: Path) -> dict:
    """The `trainer` and `checkpoint` groups `path` records ({} when it cannot be read as such)."""
    loaded = _load(path)
    return {k: loaded[k] for k in ("trainer", "checkpoint") if isinstance(loaded.get(k), dict)}


def _load(path: Path) -> dict:
    """A config file's mapping ({} when it cannot be read as one: the parser has said so already)."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _same(a: str | Path, b: str | Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def check_run_dir(root: str) -> None:
    """`--trainer.default_root_dir` refused in one line where it is a file or lies under one, before
    anything is written: the run directory's lock (fit) or the W&B run (validate, test) would fail to
    make it, the latter with a traceback."""
    path = Path(root).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {existing}"
        raise UserError(
            f"--trainer.default_root_dir {root} {where}: give a directory for the run to write in"
        )


def checkpoint_dir(config) -> Path:
    """Where the run's ModelCheckpoint writes (as `SslVitCLI.before_instantiate_classes` sets it)."""
    if config.checkpoint.dirpath:
        return Path(config.checkpoint.dirpath)
    return Path(config.trainer.default_root_dir or DEFAULT_ROOT) / "checkpoints"


def refuse_used_run_dir(checkpoint_dir: Path) -> None:
    """A fit that starts afresh would write its checkpoints under the same names as the ones already in
    `checkpoint_dir` (`step{step:07d}.ckpt`, `last.ckpt`): refused, before anything is written."""
    found = min(checkpoint_dir.glob("*.ckpt"), default=None) if checkpoint_dir.is_dir() else None
    if found is not None:
        raise UserError(
            f"{checkpoint_dir} already holds checkpoints of an earlier run ({found.name}), which a fresh "
            "start would overwrite: resume it with --ckpt_path last, or give another "
            "--trainer.default_root_dir"
        )


# --- --ckpt_path: which checkpoint a job resumes, checked before Lightning reads it -------------------


def check_ckpt_choice(subcommand: str, given: str | None) -> str | None:
    """`--ckpt_path` as given, refused in one line (each says why) where Lightning would raise from deep
    inside (`best`, an empty path) or `validate`/`test` would score a randomly initialised model."""
    fix = "give last, or the path of a .ckpt"
    if given == "best":
        raise UserError(
            f"--ckpt_path best: ssl-vit saves checkpoints by steps and monitors no metric, so none is the "
            f"best: {fix}"
        )
    if given is not None and not str(given).strip():
        raise UserError(f"--ckpt_path is empty: {fix}")
    if subcommand in ("validate", "test") and given is None:
        raise UserError(
            f"{subcommand} needs --ckpt_path (without one it would score a randomly initialised model): "
            f"{fix}, or scratch to score the initialisation on purpose"
        )
    if given == "scratch" and subcommand == "fit":
        raise UserError("--ckpt_path scratch: a fit starts from scratch without --ckpt_path; drop it")
    return given


def resumed_checkpoint(ckpt_path: str | None, checkpoint_dir: Path) -> Path | None:
    """The checkpoint `--ckpt_path` makes this job continue from: for `last`, `resumable(checkpoint_dir)`
    (as `LastLinkCheckpoint` resolves it for Lightning); a local path as it is; None otherwise."""
    if not ckpt_path:
        return None
    if str(ckpt_path) == "last":
        return resumable(checkpoint_dir)
    return Path(ckpt_path) if "://" not in str(ckpt_path) else None


# --- the checkpoint's model against the config ------------------------------------------------------------


def refuse_unknown_hparams(config, path) -> None:
    """Hyperparameters of the checkpoint that its model class does not take (jsonargparse keeps them as
    `dict_kwargs`): the class's constructor would raise a TypeError."""
    unknown = config.model.get("dict_kwargs") if config.get("model") else None
    if unknown:
        raise unparsable_model(
            path, f"{', '.join(sorted(unknown))}: no such option of {config.model.class_path}"
        )


def refuse_other_bands(hparams: dict, config, path) -> None:
    """A checkpoint's backbone of other input bands than the data's `channels` (3 unless given): the
    link would build the model for the data's bands, and the checkpoint's weights would not load."""
    backbone = hparams.get("backbone")
    if not isinstance(backbone, dict):  # not an ssl-vit task's checkpoint: Lightning says what is wrong
        return
    saved = backbone.get("in_chans", 3)  # checkpoints from before other band counts: RGB
    data = getattr(config.get("data"), "init_args", None)
    channels = (data.get("channels") if data is not None else None) or 3
    if saved != channels:
        raise UserError(
            f"--ckpt_path {path} holds a model of {saved} input bands and the data has {channels}: give it "
            f"the data it was trained on (--data.init_args.channels {saved})"
        )


def refuse_overridden_options(argv: list[str], before: dict, config, path) -> None:
    """A `--model...` option given on the command line whose value the checkpoint replaced: resuming
    would silently train the checkpoint's model instead of the one asked for."""
    after = config.as_dict()
    for arg in argv:
        if not arg.startswith("--model."):
            continue
        keys = arg[2:].split("=", 1)[0].split(".")
        old, new = lookup(before, keys), lookup(after, keys)
        if old is not MISSING and old != new:
            raise UserError(
                f"--{'.'.join(keys)} {old} contradicts --ckpt_path {path}, whose model has {new}: drop the "
                "option to resume that model, or start a new run from its weights with "
                f"--model.init_args.training.init_from {path}"
            )


def refuse_contradicting_config(before: dict, config, path, linked: Collection[str]) -> None:
    """A model value of the config file that the checkpoint being resumed replaced (another task's
    recipe, another size): the fit would silently train the checkpoint's model instead. A value the
    config leaves unset (None: the task's preset or default decides) is the checkpoint's, and so is one
    the data module sets (the `linked` keys)."""
    after = config.as_dict()
    differing = [
        f"{key} {old} (checkpoint: {new})"
        for key, old in _leaves(before.get("model"), "model")
        if old is not None
        and key not in linked
        and (new := lookup(after, key.split("."))) != old
        and not _same_class(key, old, new)
    ]
    if differing:
        raise UserError(
            f"the config's model contradicts --ckpt_path {path}, whose model differs in "
            f"{'; '.join(differing)}: "
            "resume it with the config and --model options it was trained with, or start a new run from its "
            f"weights with --model.init_args.training.init_from {path}"
        )


class _Missing:
    def __repr__(self) -> str:
        return "unset"


MISSING = _Missing()  # what `lookup` finds where a tree has no such key


def lookup(tree, keys: list[str]):
    """The value at the path `keys` of the nested mappings `tree`, or MISSING."""
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return MISSING
        tree = tree[key]
    return tree


def _same_class(key: str, old, new) -> bool:
    """Two `class_path`s that name one class the way configs spell it (`ssl_vit.tasks.X` and
    `ssl_vit.tasks.module.X`, `AdamW` and `torch.optim.AdamW`): the same class name. Compared as text,
    never imported: the checkpoint's side is data and does not choose code to run."""
    return key.endswith("class_path") and str(old).rsplit(".", 1)[-1] == str(new).rsplit(".", 1)[-1]


def _leaves(tree, prefix: str):
    """(dotted key, value) of every non-mapping value under `tree`."""
    if not isinstance(tree, dict):
        yield prefix, tree
        return
    for key, value in tree.items():
        yield from _leaves(value, f"{prefix}.{key}")
