"""Plugins: code outside ssl-vit that adds presets, targets, features, protocol kinds or `data convert`
sources.

A plugin is a Python module that registers what it adds when it is imported, through the registries'
own `register(entry)` (`ssl_vit.registry` lists them). The CLI imports every plugin
before it parses a command (`load`), so a plugin's names are valid wherever the built-in ones are:
options, recipes, suites, SOURCE strings, and in every rank of a torchrun or SLURM job (each rank runs
the command, with the job's environment). Two ways to name one:

- an installed package declares it as an entry point of the group `ssl_vit.plugins`, e.g. in its
  pyproject.toml: `[project.entry-points."ssl_vit.plugins"] mine = "my_package.ssl_vit_plugin"`;
- `SSL_VIT_PLUGINS=module[,module...]` names modules on the Python path (PYTHONPATH), e.g. one file
  `my_plugin.py` beside a recipe.

A plugin that does not import stops the command with one line naming it. `ssl-vit --help` (the list of
commands) loads none, for the reason `ssl_vit.cli.main` gives; `ssl-vit COMMAND --help` loads them.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from importlib.metadata import distributions, entry_points

from ssl_vit.errors import UserError, first_line

GROUP = "ssl_vit.plugins"  # the entry-point group of installed plugins
ENV = "SSL_VIT_PLUGINS"  # comma-separated module names

_loaded: list[str] = []  # the plugins imported so far, in order


def load() -> list[str]:
    """Import every plugin not imported yet: the installed ones (entry points of `GROUP`, by name), then
    the modules `ENV` names, in its order. Returns the names of all plugins imported so far."""
    for point in sorted(_entry_points(), key=lambda point: point.name):
        where = f"entry point {point.name!r} of {GROUP}" + (f" in {point.dist.name}" if point.dist else "")
        fix = f"reinstall or uninstall {point.dist.name if point.dist else 'its package'}"
        _import(point.value, where, fix, point.load)
    for module in filter(None, (name.strip() for name in os.environ.get(ENV, "").split(","))):
        _import(module, f"named in {ENV}", None, lambda module=module: importlib.import_module(module))
    return list(_loaded)


def _entry_points() -> list:
    """The entry points of `GROUP`. importlib reads every installed package's entry_points.txt to find
    them, and raises on one that does not parse (a line without `=`), whichever group it is in: that
    package is named, by reading the packages one by one."""
    try:
        return list(entry_points(group=GROUP))
    except Exception as err:
        bad = next((dist for dist in distributions() if not _reads(dist)), None)
        which = f"installed package {bad.name} {bad.version}" if bad is not None else "an installed package"
        raise UserError(
            f"the entry points of {which} do not read ({first_line(err)}): reinstall or uninstall it"
        ) from err


def _reads(dist) -> bool:
    try:
        return dist.entry_points is not None
    except Exception:
        return False


def _import(name: str, where: str, fix: str | None, do: Callable[[], object]) -> None:
    """Runs `do`, which imports the plugin `name`; `fix`: what the line says to do when it fails (None:
    that of a module `ENV` names, which depends on whether it was found)."""
    if name in _loaded:
        return
    try:
        do()
    # whatever a plugin raises as it registers, it is the plugin's: one line; a plugin's `sys.exit()`
    # too, which would otherwise end every command with no word (Ctrl-C stays Ctrl-C)
    except (Exception, SystemExit) as err:
        if fix is None:
            found = not isinstance(err, ModuleNotFoundError)
            fix = f"{'fix it' if found else 'put it on the Python path (PYTHONPATH)'} or take it out of {ENV}"
        raise UserError(f"plugin {name} ({where}) does not import: {first_line(err)}: {fix}") from err
    _loaded.append(name)
