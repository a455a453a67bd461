"""A run's own config.yaml written before options moved (`ShardDataModule`'s flat `crop_scale` now
`augment.crop_scale`: a class's `MOVED_OPTIONS`, old name -> new dotted name) read with each moved option
at its new place, so that the run resumes (`ssl-vit fit --config runs/X/config.yaml --ckpt_path last`)
and writes its config.yaml anew in the new form; one warning line says which options were read so.

Only a run's own file is read this way: the `config.yaml` in its `trainer.default_root_dir`, which the
run rewrites on every start. An old option in a recipe or on the command line is a mistake the user
fixes once: one line naming its new place (`ssl_vit.cli.config_errors`).

jsonargparse has no hook to rename a class's keys while it parses (its deprecation support renames the
parser's own options, not the `init_args` of a `class_path` a config chooses), so the file's text is
rewritten before it is parsed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from ssl_vit.cli.config_errors import moved_options
from ssl_vit.moved import move
from ssl_vit.run.preflight import DEFAULT_ROOT

log = logging.getLogger("ssl_vit.cli")


def with_moved_options(argv: list[str]) -> list[str] | None:
    """`argv` with each `--config` file that is a run's own config.yaml and names a moved option given
    as its text, every moved option at its new place; None when there is no such file."""
    out, moved = list(argv), []
    for i, (arg, following) in enumerate(zip(argv, [*argv[1:], None])):
        option, _, inline = arg.partition("=")
        path = inline if option == "--config" and inline else following if arg in ("--config", "-c") else None
        if not path:
            continue
        tree = _run_config(path)
        found = _move_options(tree, path) if tree is not None else []
        if found:
            text = yaml.safe_dump(tree, sort_keys=False)
            out[i] = f"--config={text}" if inline else arg
            if not inline:
                out[i + 1] = text
            moved += [f"{path}: {', '.join(f'{old} -> {new}' for old, new in found)}"]
    for line in moved:
        log.warning("options that moved read at their new places (the run writes them so): %s", line)
    return out if moved else None


def _run_config(path: str) -> dict | None:
    """The config at `path` when it is `config.yaml` in its own run directory; None otherwise."""
    if Path(path).name != "config.yaml":
        return None
    try:
        tree = yaml.safe_load(Path(path).read_text())
        root = tree["trainer"]["default_root_dir"] or DEFAULT_ROOT
        own = Path(root).resolve() == Path(path).resolve().parent
    except (OSError, yaml.YAMLError, TypeError, KeyError):
        return None  # what is wrong with it is said when it is parsed
    return tree if own else None


def _move_options(node, path: str) -> list[tuple[str, str]]:
    """Moves, in the config tree `node` (of the file `path`), each class's moved options to their new
    places; `(old, new)` of each one moved."""
    if isinstance(node, list):
        return [pair for item in node for pair in _move_options(item, path)]
    if not isinstance(node, dict):
        return []
    moved = []
    init_args = node.get("init_args")
    if isinstance(node.get("class_path"), str) and isinstance(init_args, dict):
        for old, new in moved_options(node["class_path"]).items():
            if old in init_args:
                move(init_args, old, new, path)
                moved.append((old, new))
    return moved + [pair for value in node.values() for pair in _move_options(value, path)]
