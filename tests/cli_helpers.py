"""Helpers tests import by name (a module called `conftest` is ambiguous: pytest loads several)."""

import atexit
import contextlib
import fcntl
import json
import multiprocessing
import os
import pty
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable
from pathlib import Path

import cli_client
import pytest
import torch.multiprocessing


def run_cli(*args: str, cwd=None, env=None, timeout: float = 600, check: bool = True, prelude: str = ""):
    """Run `ssl-vit ARGS` as its own process, the way a user runs the command: a child forked by the
    CLI fork server (`cli_server.py`, which pays for the imports once), with its own working
    directory, environment, stdout, stderr and exit status (`prelude`: as `start_cli`'s). Returns a
    `subprocess.CompletedProcess`."""
    proc = start_cli(*args, cwd=cwd, env=env, prelude=prelude).wait(timeout)
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


def start_cli(*args: str, cwd=None, env=None, session: bool = False, prelude: str = "") -> "RunningCli":
    """Start `ssl-vit ARGS` as `run_cli` does, without waiting for it. `session`: in a session and
    process group of its own, as a job step runs (a signal sent to the group reaches its DataLoader
    workers too). `prelude`: Python code the command's process runs before the command (a hook into
    ssl-vit, a resource limit). Commands started together run side by side."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **(env or {})}
    tmp = tempfile.mkdtemp(prefix="ssl-vit-cli-")
    fds = [os.open(os.devnull, os.O_RDONLY)]
    for name in ("stdout", "stderr"):
        fds.append(os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT, 0o644))
    try:
        conn, pid = cli_client.request(
            cli_socket(),
            list(args),
            cwd=str(cwd or os.getcwd()),
            env=full_env,
            fds=fds,
            session=session,
            prelude=prelude,
        )
    finally:
        for fd in fds:
            os.close(fd)
    return RunningCli(["ssl-vit", *args], pid, tmp, conn)


class RunningCli:
    """A command `start_cli` started: `pid`, `poll()`, `wait()`, `kill()`, as `subprocess.Popen` has.
    Every one not yet waited for is in `RUNNING` (a test's teardown kills what its test left)."""

    def __init__(self, args: list[str], pid: int, tmp: str, conn: socket.socket) -> None:
        self.args, self.pid, self._tmp, self._conn = args, pid, tmp, conn
        self.returncode: int | None = None
        self._result: subprocess.CompletedProcess | None = None
        RUNNING.add(self)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self.returncode = cli_client.answer(self._conn)["status"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Wait for the end (killing the command after `timeout` seconds); its CompletedProcess."""
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                self.kill()
                cli_client.answer(self._conn)
                self._close()
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = cli_client.answer(self._conn)["status"]
        if self._result is None:
            out, err = (Path(self._tmp, name).read_text(errors="replace") for name in ("stdout", "stderr"))
            self._result = subprocess.CompletedProcess(self.args, self.returncode, out, err)
            self._close()
        return self._result

    def _close(self) -> None:
        self._conn.close()
        shutil.rmtree(self._tmp)
        RUNNING.discard(self)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            os.kill(self.pid, signal.SIGKILL)


RUNNING: set[RunningCli] = set()


_server: subprocess.Popen | None = None
_socket = ""


def cli_socket() -> str:
    """The fork server's socket; the server is started on first use and stops when the test session
    ends (its stdin closes)."""
    global _server, _socket
    if _server is None or _server.poll() is not None:
        _socket = os.path.join(tempfile.mkdtemp(prefix="ssl-vit-cli-server-"), "socket")
        # This checkout's ssl_vit first, whatever the environment has installed.
        path = os.pathsep.join(p for p in (str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")) if p)
        _server = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("cli_server.py")), _socket],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": path},
        )  # fmt: skip
        line = _server.stdout.readline()
        if not line.startswith(b'{"ready"'):
            raise RuntimeError(f"the CLI fork server did not start: {line!r}")
        atexit.register(_server.stdin.close)  # the server's cue to stop and remove its folders
        client = Path(_socket).with_name("ssl-vit")  # one word, as a script's "$SSLVIT" may need
        # -I -S: the client needs the standard library only, and starts faster without site-packages
        client.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "{Path(cli_client.__file__)}" "$@"\n')
        client.chmod(0o755)
    return _socket


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
# What would make rich treat the terminal as another kind, or size it otherwise.
TERMINAL_OVERRIDES = ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES")


def run_on_terminal(args: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """`ssl-vit ARGS` with a pseudo-terminal (160 columns) as its stdout and stderr: its exit status and
    what it drew there, escape sequences removed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in TERMINAL_OVERRIDES}
    client = script_env()  # the fork server's command, on this terminal
    proc = subprocess.Popen(
        [client["SSLVIT"], *args], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=cwd,
        env={**env, **client, "TERM": "xterm-256color"},
    )  # fmt: skip
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1)[0]:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
    proc.wait(timeout=60)
    return proc.returncode, ANSI.sub("\n", b"".join(chunks).decode(errors="replace"))


def script_env() -> dict[str, str]:
    """What a script a test runs (make, a shell script, torchrun) needs to run its `ssl-vit` commands
    through the fork server: `SSLVIT`, an executable that runs `cli_client.py`, to call instead of
    `ssl-vit`, and the server's socket."""
    path = cli_socket()
    return {"SSLVIT": str(Path(path).with_name("ssl-vit")), cli_client.SOCKET_ENV: path}


def torchrun(*options: str) -> list[str]:
    """`torchrun OPTIONS` (nodes, ranks, the rendezvous) of `ssl-vit`, each rank a command of the fork
    server; run it with `torchrun_env()`. The ranks are what torchrun makes them (its environment, its
    signals, its restarts); only their imports are the server's."""
    client = script_env()["SSLVIT"]
    return [sys.executable, "-m", "torch.distributed.run", *options, "--no-python", client]


def torchrun_env() -> dict[str, str]:
    """The environment of a `torchrun()` command: the fork server's client, offline W&B, and one
    thread per rank (as torchrun sets)."""
    return {**os.environ, **script_env(), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}


def skip_or_fail(reason: str):
    """Skip a test whose server cannot be provided here; under CI (CI=true) that is a failure."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"required under CI: {reason}")
    pytest.skip(reason)


def apt_install(packages: list[str], present: Callable[[], bool], timeout: float) -> None:
    """Install Debian `packages` for a server a test needs unless `present()` says they are there, or
    skip (fail under CI) where that cannot be done here. The test
    processes `make test` runs take turns, checking too: dpkg installs one set at a time, and a server
    must not start from a half-unpacked package. The turn waits within the test's own timeout."""
    with open(Path(tempfile.gettempdir(), "ssl-vit-tests-apt.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if present():
            return
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            skip_or_fail(f"{' '.join(packages)}: not installed, and installing needs apt-get and root")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
        if subprocess.run(install, env=env, capture_output=True, timeout=timeout).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=timeout)
            proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                skip_or_fail(f"apt-get install {' '.join(packages)} failed: {proc.stderr.strip()[-300:]}")


def start_ranks(fn, *args, nprocs: int = 2) -> None:
    """`fn(rank, *args)` in `nprocs` new processes, as `torch.multiprocessing.spawn` runs them, but
    forked from multiprocessing's fork server: a clean process that imports torch and ssl-vit once for
    the session, where spawning would have every rank import them again (seconds each)."""
    preload = ["torch.distributed", "ssl_vit.data.datamodule", "ssl_vit.evaluation.features", fn.__module__]
    multiprocessing.set_forkserver_preload(preload)  # takes effect when the server starts, on first use
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for gloo rendezvous, test servers), below the kernel's ephemeral
    range: a port the kernel hands out for port 0 is one it may give any outgoing connection next (a
    gloo pair, a worker's HTTP request) between this check and the server's bind, which then fails
    while its peers wait for it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    low = max(1024, ephemeral - 12000)
    for port in random.Random().sample(range(low, ephemeral), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{ephemeral - 1}")


def run_lightning_ddp(script: Path, *args: str, timeout: float) -> str:
    """`python SCRIPT ARGS` for a script whose Trainer launches its own second rank (Lightning's DDP
    launcher re-runs the script), on a free port, one thread per process (as torchrun sets). Returns
    both ranks' output once both have ended; fails the test with that output if the script fails or
    the ranks outlive `timeout`.

    The script runs in its own process group, killed whole at the timeout: a rank left waiting for a
    peer that died would otherwise hold the output pipe open, and the reason with it."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)  # to the pipe's end: every rank has ended
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{script.name}: still running after {timeout:.0f} s; its output:\n{output[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{script.name} exited {proc.returncode}; its output:\n{output[-6000:]}")
    return output


def torchrun_fit(args, *, strategy: str | None = "ddp", timeout: float = 400, env: dict | None = None):
    """`ssl-vit fit ARGS` as 2 processes on this machine through torchrun (gloo), as a cluster job
    launches it; `strategy` None leaves the strategy to ARGS; `env`: more of the ranks' environment
    (`cli_client.PRELUDE_ENV`: a prelude for each rank). Returns the CompletedProcess."""
    cmd = [
        *torchrun("--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                  "--master_port", str(free_port())),
        *args, "--trainer.devices", "2", "--data.init_args.num_workers", "1",
        *(["--trainer.strategy", strategy] if strategy else []),
    ]  # fmt: skip
    root = Path(__file__).parents[1]
    env = {**torchrun_env(), **(env or {})}
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def small_fewshot_monitor(shards) -> list[str]:
    """Options that point the quickstart recipes' live few-shot probe (`FewShotMonitor`, which also runs
    at the end of every fit) at 2 training and 2 validation shards of the digits (800 images, not all
    1,797), for the fits of tests that are not about it. Given before any `--trainer.callbacks+=`: they
    set the last callback in the list, which is then the recipe's monitor."""
    return [
        "--trainer.callbacks.init_args.train_urls", f"{shards}/train-{{000000..000001}}.tar",
        "--trainer.callbacks.init_args.test_urls", f"{shards}/val-{{000000..000001}}.tar",
    ]  # fmt: skip


def one_step_fit_args(shards: Path, run: Path, *extra: str, config: str = "mpp") -> list[str]:
    """`ssl-vit fit` of a quickstart recipe on the digits shards: one training step per epoch, one
    epoch, no validation batches, run directory RUN (offline W&B unless `extra` says otherwise)."""
    root = Path(__file__).resolve().parents[1]
    return [
        "fit", "--config", str(root / f"recipes/quickstart/{config}.yaml"), *small_fewshot_monitor(shards),
        "--data.init_args.train_urls", str(shards / "train-{000000..000004}.tar"),
        "--data.init_args.val_urls", str(shards / "val-{000000..000003}.tar"),
        "--data.init_args.num_workers", "0", "--data.init_args.train_batches", "1",
        "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0",
        "--trainer.default_root_dir", str(run), *extra,
    ]  # fmt: skip


def failing_evaluation(suffix: str) -> str:
    """A prelude (`run_cli`, `start_cli`, or `cli_client.PRELUDE_ENV` for torchrun's ranks) after which
    the evaluation of every checkpoint whose path ends with `suffix` raises `RuntimeError("injected
    failure")`: a row that fails although its checkpoint loads (inputs are checked before anything runs)."""
    return f"""
from ssl_vit.evaluation import ranks
real = ranks.evaluate
def evaluate(source, *args, **kwargs):
    if source.endswith({suffix!r}):
        raise RuntimeError("injected failure")
    return real(source, *args, **kwargs)
ranks.evaluate = evaluate
"""


# A `prelude` for run_cli/start_cli: 1 GiB more than the command has mapped when it starts, so a reader
# that builds 10^14 class names, or a full repr of YAML aliases, fails in the command, not on the machine.
LIMITED = """
import re, resource
mapped = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) << 10
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), mapped + (1 << 30)))
"""


def billion_laughs(depth: int = 8) -> list[str]:
    """YAML lines defining anchors a0..a{depth}, each a list of 9 of the one before: a few hundred bytes
    that load (shared, cheaply) as 9^(depth+1) items, and whose full repr takes all the memory there is."""
    levels = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    return levels + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, depth + 1)]
