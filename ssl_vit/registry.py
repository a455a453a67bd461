"""Names that select code: one registry per extension point, each entry added by the module that defines
it with its registry's `register(entry)` (a decorator for the classes):

- masked-prediction presets, `ssl_vit.presets` (`Preset`, named by `name`);
- masked-prediction targets, `ssl_vit.targets` (`Target` subclasses, by `NAME`);
- the features a backbone gives, `ssl_vit.models.feature` (`Feature`, by `name`);
- suite protocol kinds, `ssl_vit.evaluation.protocol` (`Protocol` subclasses, by `KIND`);
- `data convert` sources, `ssl_vit.data.convert.source` (`SourceKind`, by `name`).

Adding one is that module and its registration; every list of valid names, choice and message is read
from the registry, never written out again. A plugin (`ssl_vit.plugins`) adds its own the same way, and
its names are valid wherever the built-in ones are: `Registry.choice` checks a value when it is parsed.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, Literal

from ssl_vit.errors import BadValue, shown

# A name as it is written in a recipe, a suite, a SOURCE string (`name:ARG`) and a comma-separated list
# of bench tasks: no space, colon, comma or other punctuation that one of those would split it at.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
NAME_RULE = "letters, digits, '_', '.' and '-' (at most 64, not starting with '.' or '-')"


class Registry(dict):
    """name -> entry, in the order they were registered (the order messages list them in)."""

    def __init__(
        self,
        what: str,
        key: str = "name",
        pattern: re.Pattern = NAME,
        rule: str = NAME_RULE,
        check: Callable[[Any], None] | None = None,
    ) -> None:
        super().__init__()
        self.what = what  # "preset", "target", ...: how messages name an entry
        self.key = key  # the attribute of an entry that holds its name
        self.pattern, self.rule = pattern, rule  # what a name may be, and that in words
        self.check = check  # refuses an entry (one line) for what a name alone does not say
        self.modules: dict[str, str] = {}  # name -> the module that registered it

    def add(self, entry: Any) -> Any:
        """Register `entry` under its name, returned as it is (`register = REGISTRY.add`, a plain call or a
        class decorator). A name taken already is refused in one line naming the modules of both:
        whichever of a built-in and a plugin's registers second (a plugin may be imported before the
        built-in ones of a registry are)."""
        name = getattr(entry, self.key, None)
        if not isinstance(name, str) or not self.pattern.fullmatch(name):
            raise BadValue(f"{self.what} name {shown(name)}: give one of {self.rule}")
        module = inspect.currentframe().f_back.f_globals.get("__name__")  # the caller: the registering module
        if name in self:
            by = f" (by {self.modules[name]} and {module})" if self.modules.get(name) and module else ""
            raise BadValue(f"{self.what} {name!r} is registered twice{by}: give one of them another name")
        if self.check is not None:
            self.check(entry)
        self[name], self.modules[name] = entry, module
        return entry

    def names(self, **flags: Any) -> tuple[str, ...]:
        """The names of the entries whose attributes are `flags` (all of them without)."""
        return tuple(
            name for name, entry in self.items() if all(getattr(entry, k) == v for k, v in flags.items())
        )

    def pick(self, name: str, among: tuple[str, ...] | None = None) -> Any:
        """The entry `name` selects, of `among` (default: every one); one line naming those otherwise."""
        valid = tuple(self) if among is None else among
        if not isinstance(name, str) or name not in valid:
            raise BadValue(f"unknown {self.what} {shown(name)}: use one of {', '.join(valid)}")
        return self[name]

    def choice(self, type_name: str, **flags: Any) -> type[str]:
        """A `str` type whose values are the names of the entries whose attributes are `flags`, as they
        are when a value is checked: by LightningCLI as a command parses and by pydantic as a suite
        loads, a plugin's entries included, where a `Literal` fixed when the module using it was imported
        would miss them. Values stay plain `str` (checkpoints store them as such); `valid()` lists them."""
        # jsonargparse only here, where a signature needs it: `ssl-vit bench --help` reads the presets
        # without it.
        from jsonargparse.typing import register_type

        def valid() -> tuple[str, ...]:
            return self.names(**flags)

        def parsed(value: object) -> str:
            if not isinstance(value, str) or value not in valid():
                # Worded as jsonargparse words a value outside a Literal, so that the CLI's one line
                # (`ssl_vit.cli.config_errors`) lists the valid names and the closest, as for every choice.
                raise ValueError(f"Expected a {Literal[valid()]!r}. Got value: {value}")
            return value

        def pydantic_schema(cls, source, handler):
            from pydantic_core import PydanticCustomError, core_schema

            def checked(value: str) -> str:
                if value not in valid():  # as pydantic words a value outside a Literal
                    *most, last = map(repr, valid())
                    listed = f"{', '.join(most)} or {last}" if most else last
                    raise PydanticCustomError(
                        "literal_error", "Input should be {expected}", {"expected": listed}
                    )
                return value

            return core_schema.no_info_after_validator_function(checked, core_schema.str_schema())

        option = type(type_name, (str,), {"__doc__": f"The name of a registered {self.what}."})
        option.valid, option.__get_pydantic_core_schema__ = staticmethod(valid), classmethod(pydantic_schema)
        register_type(option, serializer=str, deserializer=parsed, type_check=lambda value, kind: False)
        return option
