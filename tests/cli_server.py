"""A fork server for CLI tests: one process imports ssl-vit's CLI and what it loads (torch, Lightning,
timm, wandb: about 8 s on a 2-core machine) once, then runs each `ssl-vit ARGS` in a forked child with
its own working directory, environment, argv, stdin, stdout and stderr, and reports the exit status.
A child is a fresh process to the command (it runs `ssl_vit.cli.main` from the top, as the console
script does); only the imports are shared.

`python cli_server.py SOCKET` listens on the Unix socket SOCKET (the protocol is `cli_client.py`'s)
and runs until its stdin closes (the test session's end). Each connection gets a process of its own
that starts the command and waits for it, so commands run side by side as separate processes do:
tests (`cli_helpers.run_cli`, `start_cli`) and the scripts they run (`cli_client.py`) alike.
"""

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import sys
import tempfile
import traceback


def run_child(request: dict, fds: list[int], started: int) -> None:
    """In the forked child: become the command (stdin, stdout, stderr: `fds`), close `started` once it
    is (its own session made, when asked for), run it, exit with its status."""
    if request.get("session"):
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in {*fds, started} - {0, 1, 2}:
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    try:
        code = run_command(request)
    except SystemExit as stop:  # as the interpreter reports it
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    # What an interpreter does at exit (wandb finishes its run, logging flushes), without unwinding
    # into the server's loop.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_command(request: dict) -> int:
    """`ssl_vit.cli.main` with the request's environment, working directory, argv and prelude."""
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # the command's TMPDIR, not the one the server found first
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = extra  # PYTHONPATH is read at start-up only
    if request["env"].get("OMP_NUM_THREADS"):  # so is OMP_NUM_THREADS, by torch's thread pool
        import torch

        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    from wandb.sdk.data_types._private import MEDIA_TMP

    from ssl_vit.cli import main

    # wandb's media folder (its tables and images are staged there) is made once, by the server at
    # import, and removed at exit: each command gets its own, under the server's (removed with the
    # server: a killed command leaves it behind), so that commands side by side keep theirs.
    MEDIA_TMP._finalizer.detach()
    MEDIA_TMP.name = tempfile.mkdtemp(suffix="wandb-media", dir=MEDIA_ROOT)
    atexit.register(shutil.rmtree, MEDIA_TMP.name, True)
    if request["cwd"]:
        os.chdir(request["cwd"])
    sys.argv = ["ssl-vit", *request["argv"]]
    if request.get("prelude"):  # a test's hook into the command, or a limit on its process
        exec(request["prelude"], {"__name__": "__prelude__"})
    return main(request["argv"])


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A connection's request and the three file descriptors sent with it; EOFError if the caller is
    gone first."""
    header, fds, _, _ = socket.recv_fds(conn, 8, 3)
    data = bytearray(header)

    def fill(size: int) -> None:
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                for fd in fds:
                    os.close(fd)
                raise EOFError("the caller closed the connection")
            data.extend(chunk)

    fill(8)
    fill(8 + struct.unpack("!Q", data[:8])[0])
    return json.loads(data[8:]), fds


def handle(conn: socket.socket) -> None:
    """In a process of the connection's own: start the command, answer its pid once it runs, wait
    for it to end (or for the caller to go first: the command is killed), answer its status."""
    try:
        request, fds = receive(conn)
    except EOFError:
        os._exit(0)
    started, child_started = os.pipe()
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.close(started)
        run_child(request, fds, child_started)
    for fd in (*fds, child_started):
        os.close(fd)
    os.read(started, 1)  # EOF: the child has its session and its descriptors (or has already ended)
    os.close(started)
    kill = os.killpg if request.get("session") else os.kill
    ended, waiting = os.pidfd_open(pid), [conn]
    try:
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        while ended not in select.select([ended, *waiting], [], [])[0]:
            if not conn.recv(1):  # the caller is gone (a test that failed, a killed client)
                raise ConnectionError
    except OSError:  # ConnectionError included: nobody waits for the command any more
        waiting = []
        with contextlib.suppress(ProcessLookupError):
            kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    os._exit(0)


MEDIA_ROOT = ""  # the server's folder for its commands' wandb media folders


def serve(path: str) -> None:
    global MEDIA_ROOT
    # Everything a command imports, imported once here (no torch computation: no threads to fork).
    import pytorch_lightning  # noqa: F401
    import timm  # noqa: F401
    import wandb  # noqa: F401
    import wandb.sdk.launch.inputs.internal  # noqa: F401  (imported by every wandb.init: 1-2 s)

    import ssl_vit.cli  # noqa: F401
    import ssl_vit.cli.evaluate  # noqa: F401
    import ssl_vit.cli.fit  # noqa: F401
    import ssl_vit.data.datamodule  # noqa: F401
    import ssl_vit.tasks  # noqa: F401

    MEDIA_ROOT = tempfile.mkdtemp(prefix="ssl-vit-cli-media-")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the connections' processes: reaped by the kernel
    print(json.dumps({"ready": True}), flush=True)
    try:
        while True:
            readable = select.select([listener, sys.stdin], [], [])[0]
            if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
                return  # the test session has ended
            if listener in readable:
                conn, _ = listener.accept()
                if os.fork() == 0:
                    try:
                        listener.close()
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        handle(conn)
                    finally:
                        os._exit(1)  # never back into this loop, whatever went wrong
                conn.close()
    finally:
        listener.close()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # the socket, and the client beside it
        shutil.rmtree(MEDIA_ROOT, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
