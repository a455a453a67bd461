"""Print the pins of ssl-vit[dev]'s dependencies as installed in this interpreter's environment.

    .venv/bin/python requirements/freeze.py > requirements/constraints.txt    (what `make constraints` runs)

The walk starts from pyproject.toml (not from the installed ssl-vit's metadata, which can be older than
the file) and follows each installed distribution's own requirements, markers and extras evaluated
here, so a package that happens to sit in the environment without being needed is left out, which
`pip freeze` would keep. Every pin carries this interpreter's `python_version` marker: the versions
are the ones that ran on it, and some (numpy 2.4, scipy 1.17) no longer install on Python 3.10, where
`make install` then resolves within pyproject's ranges alone. Needs Python 3.11 or newer (tomllib).
"""

import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def closure(requirements: list[str]) -> dict[str, str]:
    """{canonical name: installed version} of every distribution the requirements pull in here."""
    pinned: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()  # (name, extra) already followed
    todo = [(Requirement(text), "") for text in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        for wanted in ["", *sorted(req.extras)]:
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            try:
                dist = metadata.distribution(name)
            except metadata.PackageNotFoundError:
                sys.exit(f"freeze.py: {req} is not installed here: `make install` first")
            pinned[name] = dist.version
            todo.extend((Requirement(text), wanted) for text in dist.requires or [])
    return pinned


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = project["dependencies"] + project["optional-dependencies"]["dev"]
    python = "{}.{}".format(*sys.version_info[:2])
    print(
        "# The exact versions `make install` installs (pip install -c requirements/constraints.txt ...)\n"
        "# and that `make test`, CI and `make study` ran with: ssl-vit[dev]'s dependencies as installed\n"
        f"# in .venv on Python {python}. pyproject.toml declares the ranges a library user gets.\n"
        "# Written by `make constraints` (requirements/freeze.py); do not edit by hand."
    )
    for name, version in sorted(closure(roots).items()):
        print(f'{name}=={version} ; python_version == "{python}"')


if __name__ == "__main__":
    main()
