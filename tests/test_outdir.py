"""The rules of every command that writes an output for the user (`evaluate`, `compare`, `analyze`,
`export`, `data convert`; `ssl_vit.storage.outdir`), through the CLI: an output that is, holds or lies
inside an input is refused in one line, with --overwrite too, and nothing is written or deleted; a second
job on the same output is refused while the first holds it; a commit never replaces another job's result; the
numbers are committed before the pictures and the W&B run, whose failures cost only themselves."""

import hashlib
import json
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml
from cli_helpers import one_step_fit_args, run_cli, start_cli
from PIL import Image
from test_errors import error_line

from ssl_vit.storage import outdir
from ssl_vit.storage.lock import HOST

ROOT = Path(__file__).resolve().parents[1]
# The quickstart MPP recipe's backbone, which the run below trains.
RUN_BACKBONE = {"variant": "S/4", "img_size": 32, "width": 64, "depth": 4, "heads": 4, "mlp_dim": 256}
TINY = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}


def knn_suite(path: Path, shards: Path, backbone: dict) -> Path:
    """A k-NN-only suite on 400 digits: seconds per checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "backbone": backbone,
        "data": {"train_urls": str(shards / "val-00000{0..1}.tar"),
                 "test_urls": str(shards / "val-00000{2..3}.tar"), "image_size": 32, "num_workers": 0},
        "protocols": [{"name": "knn", "kind": "knn", "k": 5}],
        "resamples": 100,
    }))  # fmt: skip
    return path


@pytest.fixture(scope="module")
def inputs(digits_shards, tmp_path_factory):
    """Every kind of input, each in a folder of its own under one root: a fit's run directory and its
    checkpoint, a shard directory, a suite over those shards, an image folder."""
    root = tmp_path_factory.mktemp("outdir") / "inputs"
    shards = root / "data" / "shards"
    shards.mkdir(parents=True)
    for path in [*digits_shards.glob("val-*.tar"), digits_shards / "val.json"]:
        shutil.copy(path, shards)
    run = root / "runs" / "run"
    run_cli(*one_step_fit_args(digits_shards, run), cwd=ROOT)
    photos = root / "sources" / "photos"
    (photos / "zero").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(photos / "zero" / "a.png")
    return {
        "root": root,
        "run": run,
        "checkpoint": run / "checkpoints" / "last.ckpt",
        "shards": shards,
        "suite": knn_suite(root / "suites" / "suite.yaml", shards, RUN_BACKBONE),
        "source": photos,
    }


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under `root`, with the SHA-256 of each file's bytes; W&B's own debug logs
    (`wandb/*/logs/`) by name only, since its service process may still append to them after the fit
    that started it has exited (seen on a busy CI machine)."""

    def digest(p: Path) -> str:
        if not p.is_file():
            return "dir"
        if p.parent.name == "logs" and "wandb" in p.parts:
            return "W&B log"
        return hashlib.sha256(p.read_bytes()).hexdigest()

    return {str(p.relative_to(root)): digest(p) for p in sorted(root.rglob("*"))}


def command_args(command: str, out: Path, inputs: dict, source: str = "shards") -> list[str]:
    checkpoint, shards = str(inputs["checkpoint"]), inputs["shards"]
    if command == "evaluate":
        return ["evaluate", checkpoint, "--suite", str(inputs["suite"]), "--out", str(out), "--overwrite"]
    if command == "compare":
        return [
            "compare",
            f"a={checkpoint}",
            "--suite",
            str(inputs["suite"]),
            "--out",
            str(out),
            "--overwrite",
        ]
    if command == "analyze":
        data = str(shards / "val-{000000..000003}.tar")
        return ["analyze", checkpoint, "--data", data, "--out", str(out), "--images", "4", "--overwrite"]
    if command == "export":  # (export never replaces anything: it has no --overwrite)
        return ["export", checkpoint, str(out)]
    spec = (
        f"wds:{shards}/val-{{000000..000003}}.tar"
        if source == "shards"
        else f"imagefolder:{inputs['source']}"
    )
    return ["data", "convert", spec, str(out), "--split", "copy", "--overwrite", "--no-progress"]


# How the line names each kind of input.
ROLES = {"run": "the run directory of", "checkpoint": "the checkpoint", "shards": "shard",
         "suite": "the suite", "source": "the source"}  # fmt: skip
# (command, input): every input each command reads.
# (command, input, the --out relations tried): one check serves them all (`ssl_vit.storage.outdir`), so
# each row tries one or two, and every command meets all three. `holds!`: --out holds the input's own
# folder (a re-shard reads the files its URLS name, so only their own folder can be read back as its
# input: test_hostile_round5).
TABLE = [
    *[
        (command, kind, (relation,))
        for command in ("evaluate", "compare")
        for kind, relation in zip(
            ("run", "checkpoint", "shards", "suite"), ("is", "lies inside", "holds", "is")
        )
    ],
    ("analyze", "run", ("is",)),
    ("analyze", "checkpoint", ("lies inside",)),
    ("analyze", "shards", ("holds",)),
    ("export", "run", ("is",)),
    ("export", "checkpoint", ("lies inside", "holds")),
    ("data convert", "shards", ("holds!", "holds")),
    ("data convert", "source", ("lies inside", "holds")),
]


@pytest.mark.slow
@pytest.mark.parametrize("command, kind, tried", TABLE)
def test_an_output_that_is_holds_or_lies_inside_an_input_is_refused_and_nothing_changes(
    command, kind, tried, inputs
):
    path = inputs[kind]
    before = tree(inputs["root"].parent)
    outs = {"is": path, "lies inside": path / "out", "holds": path.parent, "holds!": path}
    for relation, out in ((name.rstrip("!"), outs[name]) for name in tried):
        proc = run_cli(*command_args(command, out, inputs, kind), cwd=ROOT, check=False)
        line = error_line(proc, f"{out} {relation} ", "which this command reads")
        assert ROLES[kind] in line.split(f"{out} {relation} ")[1], line  # it names the input
        assert tree(inputs["root"].parent) == before, (relation, out)  # nothing written, nothing deleted


# --- two jobs on one output -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_suites(digits_shards, tmp_path_factory):
    """Two k-NN suites (two paths: each job's results.json names its own) of a small scratch backbone."""
    folder = tmp_path_factory.mktemp("suites")
    return [knn_suite(folder / f"{name}.yaml", digits_shards, TINY) for name in ("first", "second")]


def job(command: str, name: str, out: Path, suite: Path) -> list[str]:
    source = "scratch" if command == "evaluate" else f"{name}=scratch"
    return [command, source, "--suite", str(suite), "--out", str(out)]


def hold_before_commit(release: Path) -> str:
    """A prelude: the command computes its results, then waits for `release` before writing them
    (`RELEASE.reached` says it is there)."""
    return f"""
import time as _time
from pathlib import Path as _Path
from ssl_vit.storage import outdir as _outdir
_staged = _outdir.Output.staged
def _held(self):
    _Path({str(release) + ".reached"!r}).touch()
    while not _Path({str(release)!r}).exists():
        _time.sleep(0.02)
    return _staged(self)
_outdir.Output.staged = _held
"""


# Jobs whose locks cannot see each other: a filesystem where this host cannot check another's lock, or a
# job of a version that took none. Only the commit's own rule is left between them.
NO_LOCK = """
import contextlib as _contextlib
from ssl_vit.storage import outdir as _outdir
_outdir.out_lock = lambda *args, **kwargs: _contextlib.nullcontext()
"""


def reached(release: Path, proc) -> None:
    deadline = time.monotonic() + 180
    while not Path(f"{release}.reached").exists():
        assert proc.poll() is None, proc.wait().stderr[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def names(out: Path, command: str) -> str:
    """Which job's results `out` holds: the suite its results.json names, or compare's rows."""
    if command == "evaluate":
        return Path(json.loads((out / "results.json").read_text())["suite"]).stem
    return (out / "results.csv").read_text().splitlines()[1].split(",")[0]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["evaluate", "compare"])
def test_a_second_job_on_the_same_new_out_is_refused_naming_the_first(command, tiny_suites, tmp_path):
    out, release = tmp_path / "out", tmp_path / "release"
    first = start_cli(*job(command, "first", out, tiny_suites[0]), prelude=hold_before_commit(release))
    reached(release, first)  # computed, about to write
    # --overwrite too: no two jobs write one output at once.
    second = run_cli(*job(command, "second", out, tiny_suites[1]), "--overwrite", check=False)
    error_line(second, f"--out {out} is in use by ssl-vit {command} on host {HOST} pid {first.pid}",
               "give another --out")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{out.name}.lock", "release.reached"]
    release.touch()
    done = first.wait(180)
    assert done.returncode == 0 and "wrote " in done.stdout, done.stderr[-3000:]
    assert names(out, command) == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "release", "release.reached"]  # lock gone


@pytest.mark.slow
@pytest.mark.parametrize("command", ["evaluate", "compare"])
def test_a_commit_never_replaces_what_another_job_wrote_meanwhile(command, tiny_suites, tmp_path):
    """Two jobs that both found --out new, and whose locks do not see each other: the first to commit
    wins, the second says so in one line and keeps its results beside --out."""
    out = tmp_path / "out"
    procs = []
    for name, suite in zip(("first", "second"), tiny_suites):
        release = tmp_path / name
        prelude = NO_LOCK + hold_before_commit(release)
        procs.append((start_cli(*job(command, name, out, suite), prelude=prelude), release))
        reached(release, procs[-1][0])
    (first, first_release), (second, second_release) = procs
    first_release.touch()
    done = first.wait(180)
    assert done.returncode == 0 and "wrote " in done.stdout, done.stderr[-3000:]
    second_release.touch()
    refused = second.wait(180)
    line = error_line(refused, f"--out {out} was written by another job while this one ran", "results are in")
    kept = Path(line.split("results are in ")[1].split(";")[0])
    assert names(out, command) == "first" and names(kept, command) == "second"
    assert kept.parent == tmp_path and kept.name.startswith("out.")


HOLD_SWAP = """
import time as _time
from pathlib import Path as _Path
from ssl_vit.data.convert import shard_writer as _writer
_swap_in = _writer._swap_in
def _held(*args, **kwargs):
    _Path({reached!r}).touch()
    while not _Path({release!r}).exists():
        _time.sleep(0.02)
    return _swap_in(*args, **kwargs)
_writer._swap_in = _held
"""


@pytest.mark.slow
def test_a_second_conversion_of_a_split_is_refused_and_other_splits_convert_beside_it(tmp_path):
    out, release = tmp_path / "shards", tmp_path / "release"
    args = ["data", "convert", "synthetic:20", str(out), "--shard-size", "10", "--no-progress"]
    prelude = HOLD_SWAP.format(reached=f"{release}.reached", release=str(release))
    first = start_cli(*args, prelude=prelude)
    reached(release, first)  # its shards written, about to move them in
    holder = f"is in use by ssl-vit data convert on host {HOST} pid {first.pid}"
    second = run_cli(*args, "--overwrite", check=False)
    error_line(second, f"split 'train' of OUTDIR {out} {holder}", "give another OUTDIR or --split")
    run_cli(*args, "--split", "val")
    release.touch()
    assert first.wait(120).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "train-000000.tar", "train-000001.tar", "train.json", "val-000000.tar", "val-000001.tar", "val.json"
    ]  # fmt: skip


# --- what is optional ------------------------------------------------------------------------------------


FAILING_PLOT = """
from ssl_vit.report import writer as _report
def _plot_bars(*args, **kwargs):
    raise RuntimeError("injected plot failure")
_report.plot_bars = _plot_bars
"""
FAILING_WANDB = """
import wandb as _wandb
def _init(*args, **kwargs):
    raise _wandb.errors.CommError("injected W&B failure")
_wandb.init = _init
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "prelude, what, missing",
    [(FAILING_PLOT, "bars.png failed (RuntimeError: injected plot failure)", "bars.png"),
     (FAILING_WANDB, "the W&B run failed (CommError: injected W&B failure)", "wandb-run.json")],
)  # fmt: skip
def test_a_failing_picture_or_wandb_costs_only_itself(prelude, what, missing, tiny_suites, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(*job("compare", "first", out, tiny_suites[0]), prelude=prelude, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: warning:")]
    assert warnings == [f"ssl-vit: warning: {what}; the results are complete without it"]
    assert "Traceback" not in proc.stderr
    assert names(out, "compare") == "first" and (out / "first/results.json").is_file()
    assert f"- {what}; the results are complete without it" in (out / "results.md").read_text()
    written = {p.name for p in out.iterdir()}
    assert (
        missing not in written
        and {"results.csv", "results.md", "compute.png", "attention_distance.png"} <= written
    )
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    assert missing not in line and "results.csv" in line


FAILING_ROLLOUT = """
from ssl_vit.analysis import pictures as _pictures
def _rollout_grid(*args, **kwargs):
    raise RuntimeError("injected plot failure")
_pictures.rollout_grid = _rollout_grid
"""


@pytest.mark.slow
def test_analyze_writes_its_numbers_when_a_picture_fails(inputs, tmp_path):
    out = tmp_path / "out"
    data = str(inputs["shards"] / "val-{000000..000003}.tar")
    proc = run_cli("analyze", str(inputs["checkpoint"]), "--data", data, "--out", str(out), "--images", "4",
                   prelude=FAILING_ROLLOUT)  # fmt: skip
    what = "attention_rollout.png failed (RuntimeError: injected plot failure)"
    what += "; the results are complete without it"
    assert [line for line in proc.stderr.splitlines() if "warning" in line] == [f"ssl-vit: warning: {what}"]
    record = json.loads((out / "analysis.json").read_text())
    assert record["notes"] == [what] and "attention_rollout.png" not in record["pictures"]
    assert sorted(p.name for p in out.glob("*.png")) == record["pictures"]
    assert record["attention_distance"]["mean_per_layer"]  # the numbers


# --- --overwrite replaces only our output, and a signal never loses it ----------------------------------


@pytest.mark.parametrize("command", ["evaluate", "compare"])
def test_overwrite_refuses_a_directory_ssl_vit_did_not_write_and_deletes_nothing(
    command, tiny_suites, tmp_path
):
    thesis = tmp_path / "thesis"
    (thesis / "figures").mkdir(parents=True)
    files = {"chapter1.tex": "\\chapter{One}\n", "data.csv": "a,b\n1,2\n", "figures/f.pdf": "%PDF"}
    for name, text in files.items():
        (thesis / name).write_text(text)
    before = tree(tmp_path)
    proc = run_cli(*job(command, "first", thesis, tiny_suites[0]), "--overwrite", check=False)
    error_line(proc, f"--out {thesis} holds chapter1.tex, data.csv, figures, which ssl-vit did not write",
               "--overwrite replaces only an earlier output of ssl-vit")  # fmt: skip
    assert tree(tmp_path) == before


# A prelude: the signal SIG sent to the command itself at the AT-th point of its commit (before the AT-th
# filesystem step the commit takes: the exchange, each rename, the removal of the old output; or, AT past
# the last, once the commit returns); FALLBACK: as on a filesystem that cannot exchange two directories.
SIGNAL_IN_COMMIT = """
import os as _os, shutil as _shutil
from pathlib import Path as _Path
from ssl_vit.storage import outdir as _outdir
_state = {{"active": False, "n": 0}}
def _point():
    if _state["active"]:
        if _state["n"] == {at}:
            _os.kill(_os.getpid(), {sig})
        _state["n"] += 1
def _step(real):
    def step(*args, **kwargs):
        _point()
        return real(*args, **kwargs)
    return step
_outdir._exchange = _step((lambda a, b: False) if {fallback} else _outdir._exchange)
_Path.rename = _step(_Path.rename)
_shutil.rmtree = _step(_shutil.rmtree)
_commit = _outdir.commit
def _in_commit(*args, **kwargs):
    _state["active"] = True
    try:
        _commit(*args, **kwargs)
        _point()
    finally:
        _state["active"] = False
_outdir.commit = _in_commit
"""
# (fallback, at, signal, what --out holds when the command has ended, what it holds after the next command
# on it); None: nothing at --out.
SIGNAL_ROWS = [
    (False, 0, "SIGTERM", "first", "first"), (False, 1, "SIGTERM", "second", "second"),
    (False, 2, "SIGTERM", "second", "second"),
    (False, 0, "SIGKILL", "first", "first"), (False, 1, "SIGKILL", "second", "second"),
    (False, 2, "SIGKILL", "second", "second"),
    # without the exchange, SIGTERM is held off between the two renames
    (True, 1, "SIGTERM", "second", "second"), (True, 2, "SIGTERM", "second", "second"),
    (True, 3, "SIGTERM", "second", "second"),
    (True, 1, "SIGKILL", "first", "first"), (True, 2, "SIGKILL", None, "first"),
    (True, 3, "SIGKILL", "second", "second"), (True, 4, "SIGKILL", "second", "second"),
]  # fmt: skip


@pytest.fixture(scope="module")
def first_result(tiny_suites, tmp_path_factory) -> Path:
    """An earlier `evaluate` result (the first suite's), computed once and copied for each row."""
    out = tmp_path_factory.mktemp("first") / "out"
    run_cli(*job("evaluate", "first", out, tiny_suites[0]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fallback, at, sig, now, after", SIGNAL_ROWS)
def test_a_signal_at_any_point_of_the_commit_leaves_the_old_or_the_new_result(
    fallback, at, sig, now, after, tiny_suites, first_result, tmp_path
):
    out = tmp_path / "out"
    shutil.copytree(first_result, out)
    prelude = SIGNAL_IN_COMMIT.format(at=at, sig=f"_signal.{sig}", fallback=fallback)
    proc = run_cli(*job("evaluate", "second", out, tiny_suites[1]), "--overwrite", check=False,
                   prelude="import signal as _signal\n" + prelude)  # fmt: skip
    if sig == "SIGTERM":
        assert proc.returncode == 143 and proc.stderr.splitlines()[-1] == "ssl-vit: terminated", proc.stderr
    assert (names(out, "evaluate") if out.exists() else None) == now
    # The next command on --out (here refused: no --overwrite) puts back or removes what was left
    nxt = run_cli(*job("evaluate", "first", out, tiny_suites[0]), check=False)
    *warnings, line = nxt.stderr.splitlines()
    assert nxt.returncode == 2 and line.startswith(f"ssl-vit: error: --out {out} exists and is not empty")
    assert all(w.startswith("ssl-vit: warning: ") for w in warnings) and len(warnings) <= 3, nxt.stderr
    assert names(out, "evaluate") == after
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], nxt.stderr
    assert (out / ".ssl-vit-output").is_file()


class _Stopped(BaseException):
    pass


def _stop(signum, frame):
    raise _Stopped


def test_a_signal_another_thread_receives_is_held_off_between_the_two_renames():
    """The kernel hands a signal sent to the process to any thread that does not block it (torch's,
    W&B's): blocking it in the main thread alone let its Python handler run between the fallback's two
    renames (the row above, under load, left --out holding the old result or nothing). Sent to another
    thread here, it must still wait for the end of the block, then be delivered once."""
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    previous = signal.signal(signal.SIGTERM, _stop)
    steps = []
    try:
        with pytest.raises(_Stopped):
            with outdir._signals_held():
                signal.pthread_kill(other.ident, signal.SIGTERM)
                time.sleep(0.05)  # the handler would run here, where the main thread next checks
                steps.append("second rename")
        assert steps == ["second rename"]
        assert signal.getsignal(signal.SIGTERM) is _stop
    finally:
        signal.signal(signal.SIGTERM, previous)
        done.set()
        other.join()


def test_overwrite_through_a_symbolic_link_replaces_the_linked_result_and_keeps_the_link(
    tiny_suites, tmp_path
):
    result, link = tmp_path / "result", tmp_path / "latest"
    run_cli(*job("evaluate", "first", result, tiny_suites[0]))
    link.symlink_to(result.name)
    proc = run_cli(*job("evaluate", "second", link, tiny_suites[1]), "--overwrite", check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert link.is_symlink() and link.resolve() == result and names(link, "evaluate") == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "result"]
