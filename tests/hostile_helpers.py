"""What the property tests of hostile input share (tests/data/test_hostile_readers.py,
tests/evaluation/test_hostile_suites.py): their hypothesis settings, values of any JSON or YAML type,
edits of a valid file at any place, and the invariant of the CLI."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def bounded(examples: int):
    """Hypothesis settings of these tests: `examples` cases, the same ones on every run, no deadline,
    nothing written to a hypothesis database."""
    return settings(
        max_examples=examples, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )  # fmt: skip


HOSTILE = st.one_of(  # values of any JSON type, where a file wants one of them
    st.none(), st.booleans(), st.integers(), st.integers(2**53, 2**80), st.floats(), st.text(max_size=8),
    st.lists(st.integers() | st.text(max_size=3) | st.none(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=3), max_size=2),
    st.just({"class_path": "subprocess.Popen", "init_args": {"args": "true"}}),
)  # fmt: skip


# One value of each wrong kind, for a sweep of every place of a file: null, a flag, a list or a mapping
# where a scalar goes (a `class_path` one too), numbers huge, negative, not finite or as text, text.
WRONG = [
    None, True, [], [1, "x"], {"a": 1}, {"class_path": "subprocess.Popen", "init_args": {"args": "true"}},
    2**70, -(2**70), -1, 0, 1.5, float("nan"), float("inf"), "12", "1e-3", "", "x" * 200,
]  # fmt: skip


def places(value: object, at: tuple = ()) -> list[tuple]:
    """The path of every value inside `value` (dict keys and list indices)."""
    found = [at] if at else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        found += places(inner, (*at, key))
    return found


def replaced(value: object, at: tuple, new: object) -> object:
    """`value` with `new` at the path `at` (a new key of a mapping too), where that path still leads
    somewhere (an earlier edit may have replaced a container on it)."""
    out = copy.deepcopy(value)
    node = out
    try:
        for key in at[:-1]:
            node = node[key]
        node[at[-1]] = new
    except (KeyError, IndexError, TypeError):
        return value
    return out


def one_line_or_read(proc) -> None:
    """What the CLI may do with hostile input: read it (exit 0, or 1 for `data inspect`'s broken set), or
    stop with one `ssl-vit: error:` line and exit 2; never a traceback."""
    output = proc.stdout + proc.stderr
    # (a generated member may be named "Original Traceback", which the messages quote)
    assert "Traceback (most recent call last)" not in output, output[-3000:]
    if proc.returncode == 2:
        assert proc.stderr.splitlines()[-1].startswith("ssl-vit: error: "), output[-3000:]
        assert proc.stderr.count("ssl-vit: error:") == 1, output[-3000:]
    else:
        assert proc.returncode in (0, 1), output[-3000:]
