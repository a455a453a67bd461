"""Names that select code: one registry per extension point (masked-prediction presets and targets in
`ssl_vit.presets` and `ssl_vit.tasks.target`, the features a backbone gives in `ssl_vit.models.feature`),
each entry added by the module that defines it. Adding one is that module and its registration; every
list of valid names, choice and message is read from the registry, never written out again. A plugin
(`ssl_vit.plugins`) adds its own the same way.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from ssl_vit.errors import BadValue, shown

# A name as it is written in a recipe, a suite, a SOURCE string (`name:ARG`) and a comma-separated list
# of bench tasks: no space, colon, comma or other punctuation that one of those would split it at.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


class Registry(dict):
    """name -> entry, in the order they were registered (the order messages list them in)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what  # "preset", "target", ...: how messages name an entry

    def add(self, name: str, entry: Any) -> Any:
        """Register `entry` as `name`. A name taken already is refused in one line, naming the modules of
        both where they have one: whichever of a built-in and a plugin's registers second (a plugin may
        be imported before the built-in ones of a registry are)."""
        if not isinstance(name, str) or not name.strip():
            raise BadValue(f"a {self.what} needs a name, got {shown(name)}")
        if not NAME.fullmatch(name):
            raise BadValue(
                f"{self.what} name {shown(name)}: give one of letters, digits, '_', '.' and '-' (at most 64, "
                "not starting with '.' or '-')"
            )
        if name in self:
            modules = [getattr(e, "__module__", None) for e in (self[name], entry)]
            by = f" (by {modules[0]} and {modules[1]})" if all(modules) else ""
            raise BadValue(f"{self.what} {name!r} is registered twice{by}: give one of them another name")
        self[name] = entry
        return entry

    def pick(self, name: str) -> Any:
        """The entry `name` selects; one line naming the valid ones otherwise."""
        if not isinstance(name, str) or name not in self:
            raise BadValue(f"unknown {self.what} {shown(name)}; valid: {', '.join(self)}")
        return self[name]

    def option_type(self, type_name: str) -> type[str]:
        """A `str` type for a constructor argument that names an entry: LightningCLI checks a value
        against the registry as it is when the command parses (a plugin's entries included), where a
        `Literal` fixed when the task's module was imported would miss what plugins add later. The
        value the constructor gets is a plain `str` (checkpoints store it as such)."""
        # jsonargparse only here, where a task's signature needs it: `ssl-vit bench --help` reads the
        # presets without it.
        from jsonargparse.typing import register_type

        option = type(type_name, (str,), {"__doc__": f"The name of a registered {self.what}."})
        register_type(option, serializer=str, deserializer=self._parsed, type_check=lambda value, kind: False)
        return option

    def _parsed(self, value: object) -> str:
        if not isinstance(value, str) or value not in self:
            # Worded as jsonargparse words a value outside a Literal, so that the fit CLI's one line
            # (`ssl_vit.cli.fit.config_error`) lists the valid names and the closest, as for every choice.
            raise ValueError(f"Expected a {Literal[tuple(self)]!r}")
        return value
