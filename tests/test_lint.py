"""The package's lint, run by `make test` as well as `make lint`: pyproject.toml's ruff rules, among
them complexity (C901) at most 15 per function, hold on every module, so a function that takes on a
second job fails the suite rather than waiting for a review."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_function_keeps_to_the_complexity_bound_and_the_lint_rules():
    config = (ROOT / "pyproject.toml").read_text()
    assert '"C901"]' in config and "[tool.ruff.lint.mccabe]\nmax-complexity = 15\n" in config
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run(
        [str(ruff), "check", "--no-cache", "--output-format", "concise", "ssl_vit", "tests"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
