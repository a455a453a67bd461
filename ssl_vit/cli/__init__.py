"""The `ssl-vit` command.

`fit`, `validate` and `test` are LightningCLI (`ssl_vit.cli.fit`, imported only when one of them runs).
Every other subcommand is an argparse subparser registered by the module that owns the concept, so this
file only dispatches, and turns what a command raises into its one line and exit status.
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
import threading

from ssl_vit import plugins
from ssl_vit.errors import Interrupted, resource_error_message, user_error_message
from ssl_vit.quiet import quiet, verbose_requested
from ssl_vit.redact import redact, redact_logs
from ssl_vit.signals import Terminated, raises, received, recorded

LIGHTNING_COMMANDS = ("fit", "validate", "test")


def build_parser() -> argparse.ArgumentParser:
    from ssl_vit.cli import analyze as analysis_commands
    from ssl_vit.cli import bench as bench_commands
    from ssl_vit.cli import data as data_commands
    from ssl_vit.cli import evaluate as evaluation_commands
    from ssl_vit.cli import export as checkpoint_commands
    from ssl_vit.cli import info, status

    parser = argparse.ArgumentParser(prog="ssl-vit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in LIGHTNING_COMMANDS:
        sub.add_parser(
            name, help=f"LightningCLI {name}: ssl-vit {name} --config RECIPE.yaml [--key value ...]"
        )
    info.add_parser(sub)
    data_commands.add_parser(sub)
    evaluation_commands.add_parsers(sub)
    checkpoint_commands.add_parser(sub)
    analysis_commands.add_parser(sub)
    status.add_parser(sub)
    bench = sub.add_parser("bench", help="throughput benchmarks, as ratios against a reference run")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    data_commands.add_bench_parser(bench_sub)
    bench_commands.add_bench_parsers(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user's mistake, however deep it was raised and however it was wrapped on the
    way up, ends as one line, `ssl-vit: error: WHAT: FIX`, and exit status 2; the machine running out
    of memory or disk space, or a DataLoader worker dying, as one such line and exit status 1. A
    mistake in a fit's config is such a line too (`ssl_vit.cli.config_errors`); argparse's own usage
    errors of the other commands pass through as they are (usage message, exit 2)."""
    verbose, argv = verbose_requested(sys.argv[1:] if argv is None else argv)
    quiet(verbose)
    redact_logs()  # a credential never in a log line, whoever logs it
    try:
        if argv and argv[0] not in ("-h", "--help"):
            # Before any parser: a plugin's presets, targets, kinds and sources are valid names. Not for
            # `ssl-vit --help`: plugins add names within commands (shown by each command's --help, which
            # loads them), never commands, and a plugin that hangs or fails must not hide the list.
            plugins.load()
        if argv and argv[0] in LIGHTNING_COMMANDS:
            # Until the trainer's own handlers take over (a fit's from its setup on: a checkpoint at the
            # step's end, `ssl_vit.run.preemption`), SIGTERM ends the command with its one line, the run
            # directory's lock released, and SLURM's requeue signal (SIGUSR1, whose default action would
            # end the job unsaved and never requeued) is kept for the training to act on when it starts.
            with raises(signal.SIGTERM, Terminated), recorded(signal.SIGUSR1):
                from ssl_vit.cli.fit import SslVitCLI  # Lightning and every task: only for these commands

                SslVitCLI(argv)
            return 0
        args = build_parser().parse_args(argv)
        # Ctrl-C and a scheduler's SIGTERM end a command by exceptions, so that what it cleans up on the way
        # out (a staged --out, a half-written shard, a temporary directory) is cleaned up; `fit` has its
        # own meaning for SIGTERM (a checkpoint, `ssl_vit.run.preemption`).
        with (
            raises(signal.SIGINT, Interrupted, in_children=KeyboardInterrupt),
            raises(signal.SIGTERM, Terminated),
        ):
            return args.func(args) or 0
    except Exception as err:
        message = user_error_message(err)
        if message is not None:
            # raised in or past a DataLoader (a split with no usable sample): its workers end now
            _end_early()
            print(f"ssl-vit: error: {redact(message)}", file=sys.stderr)
            return 2
        message = resource_error_message(err)
        if message is None:
            raise
        stop = next((s for s in (signal.SIGINT, signal.SIGTERM) if received(s)), None)
        if stop is not None:
            # The stop came first: a DataLoader worker killed by the same signal (Ctrl-C and a
            # scheduler's SIGTERM reach the whole process group) is its consequence, not news.
            return _stopped(stop, _saved(err))
        _end_early()
        message += _saved(err)
        print(f"ssl-vit: error: {redact(message)}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted):
        # Ctrl-C: every command writes its outputs whole or not at all, so there is nothing to show.
        return _stopped(signal.SIGINT)
    except Terminated:
        return _stopped(signal.SIGTERM)
    except SystemExit as stop:
        if type(stop).__name__ != "SIGTERMException":  # Lightning's, raised on every rank at one step
            raise
        # `ssl_vit.run.preemption` saved last.ckpt and wrote what happened into the exception (rank 0
        # of a requeued job has printed it already: SLURM may stop the job any moment).
        if str(stop):
            print(f"ssl-vit: {stop}", file=sys.stderr)
        return 0 if getattr(stop, "requeued", False) else 128 + signal.SIGTERM


def _saved(err: Exception) -> str:
    """What the line of a run ended by `err` adds when `ssl_vit.run.preemption` saved its state."""
    saved = getattr(err, "saved", None)
    return f"; saved {saved}: resume with the same command and --ckpt_path last" if saved else ""


def _stopped(signum: int, saved: str = "") -> int:
    """A command ended by Ctrl-C or SIGTERM: its one line and exit status (128 + the signal)."""
    _end_early()
    print(f"ssl-vit: {'interrupted' if signum == signal.SIGINT else 'terminated'}{saved}", file=sys.stderr)
    return 128 + signum


def _end_early() -> None:
    """A command stopped by a signal or by the machine (a dead DataLoader worker, memory, disk): its
    DataLoaders are torn down now, not after its last line (a surviving worker, left to the exit,
    would sit out its SIGTERM grace, `WORKER_SIGTERM_GRACE_S`, before the process could end), and what
    that raises where nothing can catch it (a worker's connection reset while it was handing over a
    batch, in `__del__` or in the pin-memory thread) is a consequence of the stop, not news."""
    consequences = (ConnectionError, EOFError, BrokenPipeError)

    def unraisable(info) -> None:
        if not isinstance(info.exc_value, consequences):
            sys.__unraisablehook__(info)

    def in_thread(info) -> None:
        if not isinstance(info.exc_value, consequences):
            threading.__excepthook__(info)

    sys.unraisablehook, threading.excepthook = unraisable, in_thread
    workers = sys.modules.get("ssl_vit.data.stream.workers")
    if workers is not None:
        workers.stop_all_workers()
    gc.collect()
