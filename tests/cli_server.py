"""A fork server for CLI tests: one process imports ssl-vit's CLI and what it loads (torch, Lightning,
timm, wandb: about 8 s on a 2-core machine) once, then runs each `ssl-vit ARGS` in a forked child with
its own working directory, environment, argv, stdout and stderr, and reports the exit status. A child
is a fresh process to the command (it runs `ssl_vit.cli.main` from the top, as the console script
does); only the imports are shared.

Protocol, one JSON object per line: the test writes {"argv", "cwd", "env", "out", "err", "session"}
(session: true starts the command in a session of its own, as a job step runs); the server
answers {"pid"} once the child runs, then {"status"} (as `subprocess` reports it) when it ends.
"""

import atexit
import json
import os
import sys
import traceback


def run_child(request: dict) -> None:
    """In the forked child: become the command, run it, exit with its status."""
    if request.get("session"):
        os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = extra  # PYTHONPATH is read at start-up only
    if request["env"].get("OMP_NUM_THREADS"):  # so is OMP_NUM_THREADS, by torch's thread pool
        import torch

        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    if request["cwd"]:
        os.chdir(request["cwd"])
    sys.argv = ["ssl-vit", *request["argv"]]
    from wandb.sdk.data_types._private import MEDIA_TMP

    from ssl_vit.cli import main

    # wandb's media folder is made once, by the server at import, and removed by the exit of the first
    # child (its finalizer runs there): every child makes sure it is there for its W&B tables and images.
    os.makedirs(MEDIA_TMP.name, exist_ok=True)

    try:
        code = main(request["argv"])
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


def serve() -> None:
    # Everything a command imports, imported once here (no torch computation: no threads to fork).
    import pytorch_lightning  # noqa: F401
    import timm  # noqa: F401
    import wandb  # noqa: F401

    import ssl_vit.cli  # noqa: F401
    import ssl_vit.data.datamodule  # noqa: F401
    import ssl_vit.evaluation.commands  # noqa: F401
    import ssl_vit.tasks  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"status": code}), flush=True)


if __name__ == "__main__":
    serve()
