"""Helpers tests import by name (a module called `conftest` is ambiguous: pytest loads several)."""

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def run_cli(*args: str, cwd=None, env=None, timeout: float = 600, check: bool = True):
    """Run `ssl-vit ARGS` as its own process, the way a user runs the command: a child forked by the
    CLI fork server (`cli_server.py`, which pays for the imports once), with its own working
    directory, environment, stdout, stderr and exit status. Returns a `subprocess.CompletedProcess`."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **(env or {})}
    server = _cli_server()
    with tempfile.TemporaryDirectory(prefix="ssl-vit-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = {
            "argv": list(args),
            "cwd": str(cwd or os.getcwd()),
            "env": full_env,
            "out": out,
            "err": err,
        }
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        pid = json.loads(server.stdout.readline())["pid"]
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            server.stdout.readline()
            raise subprocess.TimeoutExpired(["ssl-vit", *args], timeout)
        status = json.loads(server.stdout.readline())["status"]
        proc = subprocess.CompletedProcess(
            ["ssl-vit", *args],
            status,
            Path(out).read_text(errors="replace"),
            Path(err).read_text(errors="replace"),
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"ssl-vit {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def wandb_records(run_dir: Path) -> list[tuple[str, list[dict]]]:
    """(offline run directory, its records) for each offline W&B run, read with wandb's own reader."""
    wandb = Path(sys.executable).parent / "wandb"
    out = []
    for run in sorted((run_dir / "wandb").glob("offline-run-*")):
        text = subprocess.run(
            [str(wandb), "leet", "inspect", "--json", str(run)],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip
        out.append((run.name, [json.loads(line) for line in text.splitlines() if line.startswith("{")]))
    return out


_server: subprocess.Popen | None = None


def _cli_server() -> subprocess.Popen:
    """The fork server, started on first use and stopped when the test session ends."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("cli_server.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "WANDB_MODE": "offline"},
        )
        line = _server.stdout.readline()
        if not line.startswith('{"ready"'):
            raise RuntimeError(f"the CLI fork server did not start: {line!r}")
        atexit.register(_server.kill)
    return _server


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


def torchrun_fit(args, *, strategy: str | None = "ddp", timeout: float = 400):
    """`ssl-vit fit ARGS` as 2 processes on this machine through torchrun (gloo), as a cluster job
    launches it; `strategy` None leaves the strategy to ARGS. Returns the CompletedProcess."""
    tests = Path(__file__).parent
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tests)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "ssl_vit", *args,
        "--trainer.devices", "2", "--data.init_args.num_workers", "1",
        *(["--trainer.strategy", strategy] if strategy else []),
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=tests.parent, env=env, capture_output=True, text=True, timeout=timeout)
