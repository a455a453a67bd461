"""`ssl-vit ARGS` run by the tests' CLI fork server (`cli_server.py`), for scripts: a test hands this
file to a shell script, make or torchrun as their `ssl-vit` (`cli_helpers.script_env`), and each
command it runs starts in milliseconds instead of importing torch, Lightning, timm and wandb again.
It is the command to its caller: the same stdin, stdout and stderr, signals passed on, the command's
exit status (or its death by a signal) as its own. Standard library only, so that it starts fast.

Protocol, one Unix socket connection per command: the client sends an 8-byte length with the
command's stdin, stdout and stderr attached as file descriptors, then that many bytes of JSON
{"argv", "cwd", "env", "session", "prelude"} (session: true starts the command in a session of its
own, as a job step runs; prelude: Python code the command's process runs first, a test's hook or
limit); the server answers {"pid"} once the command's process is set up (its session made), then
{"status"} (as `subprocess` reports it) when it ends. A connection closed before the end kills the
command (its process group, when it has a session).
"""

import contextlib
import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "SSL_VIT_CLI_SOCKET"  # the server's socket, for this script
PRELUDE_ENV = "SSL_VIT_CLI_PRELUDE"  # Python the command's process runs first (a test's hook), if set
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)


def request(path: str, argv: list[str], *, cwd: str, env: dict, fds: list[int], session=False, prelude=""):
    """Ask the server at `path` to run `ssl-vit ARGV` on `fds` (stdin, stdout, stderr): the open
    connection and the command's pid."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    body = json.dumps({"argv": argv, "cwd": cwd, "env": env, "session": session, "prelude": prelude})
    body = body.encode()
    socket.send_fds(conn, [struct.pack("!Q", len(body))], fds)
    conn.sendall(body)
    return conn, answer(conn)["pid"]


def answer(conn: socket.socket) -> dict:
    """The server's next answer. Read a byte at a time: a read never takes the next answer along,
    which `select` on the socket would then not see."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            raise ConnectionError("the CLI fork server closed the connection")
        line += byte
    return json.loads(line)


def main() -> None:
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:  # closed by the caller: the command gets /dev/null there
            fds.append(os.open(os.devnull, os.O_RDWR))
    # The command runs in a session of its own, as a process torchrun or a scheduler starts does: a
    # signal to this client reaches it and its DataLoader workers. One that comes before the command
    # runs is passed on once it does.
    pid, pending = None, []

    def forward(number, _frame) -> None:
        if pid is None:
            pending.append(number)
            return
        with contextlib.suppress(ProcessLookupError):  # it has just ended: its status follows
            os.killpg(pid, number)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    env, path = dict(os.environ), os.environ[SOCKET_ENV]
    prelude = env.pop(PRELUDE_ENV, "")  # a test's hook for the commands a script or torchrun starts
    conn, pid = request(path, sys.argv[1:], cwd=os.getcwd(), env=env, fds=fds, session=True, prelude=prelude)
    for number in pending:
        forward(number, None)
    status = answer(conn)["status"]
    if status < 0:  # killed by a signal: so is this process, as its caller expects
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main()
