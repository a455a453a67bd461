"""A mistake in a fit's config (a file or the command line) as one line, `KEY: WHAT`, with the closest
valid key, class or choice: what `ssl-vit fit/validate/test` says instead of jsonargparse's usage message
and nested report of every alternative of a Union type (80 lines for a typo).

jsonargparse reports a mistake as a tree: each nested class's parser, each alternative of a Union type
("Expected a <class 'NoneType'>"), the value as it was given. It has no structured form of it (its
exceptions carry text), so the tree's lines are read here: each line's indentation says which `Parser
key "K"` and `class_path` it lies under, and the deepest, most specific finding is the mistake. A message
of a kind not read here still ends as one line.
"""

from __future__ import annotations

import difflib
import importlib
import re
from pathlib import Path
from typing import NamedTuple

import yaml
from jsonargparse import ArgumentParser

from ssl_vit.internals import option_names
from ssl_vit.run.preflight import MISSING, config_files, lookup

_PARSER_KEY = re.compile(r'Parser key "([^"]+)":?\s*(.*)')
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)':?")
_CALLABLE = re.compile(r"expects a function or a callable class:\s*(.*)")  # an optimizer: init_args follow
_KINDS = (  # (kind, pattern), the more specific first
    ("unknown", re.compile(r"Option '([^']+)' is not accepted")),
    ("unknown", re.compile(r"Subcommand '[^']+' does not accept option '([^']+)'")),
    ("unknown", re.compile(r"unrecognized arguments: --?([^\s=]+)")),
    ("unknown", re.compile(r"Group '([^']+)' does not accept option '([^']+)'")),  # in a recipe's group
    ("no_class", re.compile(r"module '([^']+)' has no attribute '([^']+)'")),
    ("no_file", re.compile(r"Expected a path but (\S+) either not accessible or invalid")),
    ("no_file", re.compile(r"(?:File|Path) does not exist: '([^']+)'")),
    ("no_module", re.compile(r"No module named '([^']+)'")),
    ("required", re.compile(r"the following arguments are required: (.*)")),
    ("no_value", re.compile(r"argument --(\S+): expected one argument")),
    ("yaml", re.compile(r"Problems parsing config")),
    ("not_mapping", re.compile(r"^Unexpected config: ?(.*)")),  # a --config file of a list or a word
    ("no_group", re.compile(r"Unable to load config ['\"]?(.*?)['\"]?$")),  # a group given a word
    ("length", re.compile(r"Expected a tuple with (\d+) elements")),
    ("type", re.compile(r"Expected a (typing\.Literal\[.*\]|<class '[\w.]+'>|dot import path)")),
)
_IMPORT_PATH = "class's import path (package.module.Name)"
_GIVEN = re.compile(r"(?:Given|Got) value: (.*?)(?:\. Got value: .*)?$")
_CONFIG_FILE = re.compile(r"\.(ya?ml|json|jsonnet)$|/")


class _Finding(NamedTuple):
    rank: int  # of its kind in _KINDS
    depth: int  # minus the number of keys: deeper first
    line: int
    kind: str
    keys: tuple[str, ...]  # the dotted key it lies under, `init_args` included
    cls: str | None  # the class_path of the innermost class it lies under
    match: re.Match
    given: str | None  # the value as given, where the message says it


def config_error(message: str, argv: list[str], parser, err: BaseException) -> str:
    """`KEY: WHAT` for jsonargparse's `message` about a config of the command `argv`; `parser` is the
    subcommand's parser, whose options are the valid keys at the top."""
    findings = sorted(_findings(message))
    if not findings:
        lines = [line.strip(" -") for line in message.splitlines() if line.strip(" -")]
        return " ... ".join(dict.fromkeys([lines[0], lines[-1]]))[:400] if lines else type(err).__name__
    kind, keys, cls, match, given = findings[0][3:]
    key = ".".join(keys)
    if kind == "unknown":  # `augment.mixup_alfa` where a group's option is refused
        return _unknown_key(argv, keys, ".".join(filter(None, match.groups())), cls, parser)
    if kind == "no_class":
        module, name = match[1], match[2]
        imported = importlib.import_module(module)
        close = difflib.get_close_matches(name, getattr(imported, "__all__", dir(imported)), n=1)
        hint = f"; did you mean {module}.{close[0]}?" if close else ""
        return f"{_where(argv, _class_key(keys))}: {module} has no class {name}{hint}"
    if kind == "no_module":
        return f"{_where(argv, _class_key(keys))}: {cls or match[1]} is not a class: {match[0]}"
    if kind == "no_file":
        if keys in ((), ("config",)):
            return f"--config {match[1]}: no such file"
        return f"{_where(argv, key)}: no such file {match[1]} (a config names files relative to itself)"
    if kind == "required":
        missing = ", ".join(name.split(".", 1)[-1] for name in match[1].split(", "))
        return f"{missing}: required: give --config RECIPE.yaml (recipes/) or --{missing}.class_path CLASS"
    if kind == "no_value":
        return f"--{match[1]}: expected a value"
    if kind == "length":
        return f"{_where(argv, key)}: {given} is not {match[1]} values: give a list of {match[1]}"
    if kind in ("yaml", "not_mapping"):
        return _yaml_error(argv, err)
    if kind == "no_group":
        return (
            f"{_where(argv, key)}: {match[1]!r} is not a group of options nor a file of them: give its keys "
            f"(--{key}.KEY VALUE, or {keys[-1]}: {{KEY: VALUE}} in a recipe)"
        )
    types = [f.match[1] for f in findings if f.kind == "type" and f.keys == keys]
    return _type_error(argv, key, types, given)


def _findings(message: str) -> list[_Finding]:
    """What jsonargparse's `message` reports, each under the keys and class it lies under."""
    stack: list[tuple[int, str, str | None]] = []  # (indentation, key, class_path) of enclosing lines
    found = []
    lines = message.splitlines()
    for number, line in enumerate(lines):
        body = line.lstrip(" -")
        if not body.strip():
            continue
        indent = len(line) - len(body)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        while body:
            if match := _PARSER_KEY.match(body):
                stack.append((indent, match[1], None))
                body = match[2]
            elif match := _CLASS_PATH.match(body):
                stack.append((indent, "init_args", match[1]))
                body = body[match.end() :].strip()
            elif match := _CALLABLE.search(body):
                named = re.search(r"class_path='([^']+)'", "\n".join(lines[number:]))
                stack.append((indent, "init_args", named[1] if named else None))
                body = match[1]
            else:
                found += _kind(body, lines[number:], stack, number)
                body = ""
    return found


def _kind(body: str, rest: list[str], stack: list, number: int) -> list[_Finding]:
    """The finding the text `body` states, if any; `rest`: the message from its line on."""
    for rank, (kind, pattern) in enumerate(_KINDS):
        match = pattern.search(body)
        # jsonargparse offers every nested value a file to read it from: a mistake only if it names one
        if match and not (
            kind == "no_file" and "Expected a path" in body and not _CONFIG_FILE.search(match[1])
        ):
            given = next(filter(None, (_GIVEN.search(text) for text in rest)), None)
            keys = tuple(key for _, key, _ in stack)
            cls = next((c for _, _, c in reversed(stack) if c), None)
            return [_Finding(rank, -len(keys), number, kind, keys, cls, match, given and given[1])]
    return []


def _unknown_key(argv: list[str], keys: tuple[str, ...], name: str, cls: str | None, parser) -> str:
    """`KEY: no such option`, with the closest of the options of the class (or command) it was given to;
    `KEY: moved to NEW` for an option the class moved (`moved_options`), or one inside it."""
    where = _where(argv, ".".join([*keys, name]))
    option, dot, inside = name.partition(".")  # `optimizer.init_args.lr`: inside the moved `optimizer`
    moved = moved_options(cls).get(option) if cls else None
    if moved is not None:
        return f"{where}: moved to {where.split(' (in ')[0].removesuffix(name)}{moved}{dot}{inside}"
    options = _class_options(cls) if cls else option_names(parser)
    close = difflib.get_close_matches(name, [o for o in options if not o.endswith("help")], n=1)
    dash = "--" if where.startswith("--") else ""
    hint = f"; did you mean {dash}{'.'.join([*keys, close[0]])}?" if close else ""
    command = f"ssl-vit {argv[0] if argv else 'fit'}"
    lists = f"{command} --{'.'.join(keys[:-1])}.help {cls}" if cls else f"{command} --help"
    return f"{where}: no such option{f' of {cls}' if cls else ''}{hint} ({lists} lists them)"


def _class_options(class_path: str) -> list[str]:
    """The options of the class `class_path` names (its constructor's parameters, nested ones dotted),
    as jsonargparse builds them."""
    options = ArgumentParser(exit_on_error=False)
    options.add_class_arguments(import_class(class_path), fail_untyped=False)
    return option_names(options)


def moved_options(class_path: str) -> dict[str, str]:
    """The options the class `class_path` names moved: its `MOVED_OPTIONS`, old name -> new dotted name
    (`ShardDataModule`'s `crop_scale` -> `augment.crop_scale`)."""
    try:
        return dict(getattr(import_class(class_path), "MOVED_OPTIONS", {}))
    except (ImportError, AttributeError, ValueError):
        return {}


def import_class(class_path: str) -> type:
    """The class a config's `class_path` (`package.module.Name`) names."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _class_key(keys: tuple[str, ...]) -> str:
    """The `class_path` key of the class whose `init_args` are `keys`."""
    return ".".join([*(keys[:-1] if keys and keys[-1] == "init_args" else keys), "class_path"])


def _where(argv: list[str], key: str) -> str:
    """`key` as the user gave it: `--KEY` on the command line (where init_args may be left out), else
    `KEY (in FILE)` for the `--config` file that holds it."""
    short = key.replace(".init_args.", ".")
    for arg in argv:
        option = arg.split("=", 1)[0].removesuffix("+")  # `--trainer.callbacks+=CLASS` appends
        if option[2:] in (key, short) and arg.startswith("--"):
            return option
    for path in reversed(config_files(argv)):
        try:
            tree = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if any(lookup(tree, dotted.split(".")) is not MISSING for dotted in (key, short)):
            return f"{key} (in {path})"
    return key


def _type_error(argv: list[str], key: str, expected: list[str], given: str | None) -> str:
    """`KEY: VALUE is not TYPE` (the types a Union allows but None, which is never the mistake), the
    choices and the closest one for a Literal."""
    value = repr(given) if given is not None else "the value"
    where = _where(argv, key)
    for text in expected:
        if text.startswith("typing.Literal"):
            choices = re.findall(r"'([^']*)'", text)
            close = difflib.get_close_matches(str(given), choices, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            return f"{where}: {value} is not one of {', '.join(choices)}{hint}"
    names = [_type_name(text) for text in expected]
    names = [name for name in dict.fromkeys(names) if name != "NoneType"]
    if len(names) > 1 and _IMPORT_PATH in names:  # a Tensor's, a callable's: not what a value is meant as
        names.remove(_IMPORT_PATH)
    if not names:
        return f"{where}: {value} is not a value it takes (ssl-vit {argv[0] if argv else 'fit'} --help)"
    return f"{where}: {value} is not {' or '.join(('an ' if n[0] in 'aeiou' else 'a ') + n for n in names)}"


def _type_name(expected: str) -> str:
    """`int` for jsonargparse's `<class 'int'>`."""
    if expected == "dot import path":
        return _IMPORT_PATH
    return re.search(r"'([\w.]+)'", expected)[1].rsplit(".", 1)[-1]


def _yaml_error(argv: list[str], err: BaseException) -> str:
    """`--config FILE: not YAML: line L, column C: PROBLEM`, or `--config FILE: holds a list, not a
    mapping`; the file is found by reading each `--config` file again (jsonargparse's message names
    none)."""
    for path in config_files(argv):
        try:
            tree = yaml.safe_load(Path(path).read_text())
        except yaml.MarkedYAMLError as bad:
            mark = bad.problem_mark
            return f"--config {path}: not YAML: line {mark.line + 1}, column {mark.column + 1}: {bad.problem}"
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(tree, dict):  # jsonargparse: "Unexpected config"
            got = "nothing" if tree is None else f"a {type(tree).__name__}"
            return f"--config {path}: holds {got}, not a mapping of options: give KEY: VALUE lines (recipes/)"
    cause = next((c for c in _causes(err) if isinstance(c, yaml.YAMLError)), err)
    return f"a config is not YAML: {' '.join(line.strip() for line in str(cause).splitlines()[:4])}"


def _causes(err: BaseException | None):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__
