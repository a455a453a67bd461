"""Helpers tests import by name (a module called `conftest` is ambiguous: pytest loads several)."""

import os
import socket
import subprocess
import sys

import pytest


def run_cli(*args: str, cwd=None, env=None, timeout: float = 600, check: bool = True):
    """Run `python -m ssl_vit ARGS` in a subprocess, the way a user runs the command."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "ssl_vit", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"ssl-vit {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def skip_or_fail(reason: str):
    """Skip a test whose server cannot be provided here; under CI (CI=true) that is a failure."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"required under CI: {reason}")
    pytest.skip(reason)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for gloo rendezvous, test servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
