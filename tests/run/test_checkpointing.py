"""How ssl-vit writes and reads checkpoints (ssl_vit.checkpoints.store, ssl_vit.run.last_link): loading
never runs code from a pickle (local file or http), saves survive SIGKILL, last.ckpt is a hard link,
quickstart fits resume."""

import errno
import filecmp
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli, small_fewshot_monitor
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel
from test_fit_cli import quickstart_overrides

from ssl_vit.checkpoints import store
from ssl_vit.checkpoints.store import SafeCheckpointIO
from ssl_vit.cli import main
from ssl_vit.errors import UserError
from ssl_vit.run.last_link import LastLinkCheckpoint
from ssl_vit.storage.atomic import TEMP_NAME

pytest_plugins = ["server_helpers"]  # the `nginx` fixture

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes/quickstart"
# What a checkpoint needs to resume a fit: weights, optimizer, schedule, loops, callbacks, datamodule.
COMPLETE = {
    "state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "global_step", "epoch",
    "hyper_parameters", "pytorch-lightning_version", "ShardDataModule",
}  # fmt: skip


def fit_args(shards: Path, run: Path, *extra: str, recipe: str = "mpp") -> list[str]:
    """A quickstart fit on the digits shards, writing only to `run`."""
    return [
        "fit", "--config", str(RECIPES / f"{recipe}.yaml"), *small_fewshot_monitor(shards),
        *quickstart_overrides(shards),
        "--trainer.default_root_dir", str(run),
        # LearningRateMonitor needs a logger; CSV starts instantly, W&B's offline run does not.
        "--trainer.logger", "pytorch_lightning.loggers.CSVLogger",
        "--trainer.logger.init_args.save_dir", str(run),
        "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", *extra,
    ]  # fmt: skip


def global_step(path: Path) -> int:
    """The step a checkpoint was saved at; its tensors are mapped, not read."""
    return torch.load(path, weights_only=True, map_location="cpu", mmap=True)["global_step"]


def version(path: Path):
    """Identifies one write of a file: a replaced file has a new inode, mtime or size."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class RunsCode:
    """Unpickling this runs `touch MARKER`: the pickle holds os.system and its argument."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_code_checkpoint(path: Path, marker: Path) -> None:
    """A file shaped like a Lightning checkpoint whose pickle runs code."""
    torch.save({"state_dict": {}, "hyper_parameters": {}, "epoch": 0, "payload": RunsCode(marker)}, path)


def assert_refused(proc, name: str, marker: Path, run: Path) -> None:
    assert not marker.exists(), "the checkpoint's pickle ran code"
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error: ")]
    assert len(errors) == 1 and name in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    checkpoints = run / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())


@pytest.mark.slow
def test_http_checkpoint_that_runs_code_is_refused(nginx, digits_shards, tmp_path):
    base, www = nginx
    marker = tmp_path / "MARKER"
    write_code_checkpoint(www / "evil.ckpt", marker)
    run = tmp_path / "run"
    proc = run_cli(*fit_args(digits_shards, run, "--ckpt_path", f"{base}/evil.ckpt"), cwd=ROOT, check=False)
    assert_refused(proc, f"{base}/evil.ckpt", marker, run)
    assert "needs to run code to unpickle" in proc.stderr


@pytest.mark.slow
def test_local_checkpoint_that_runs_code_is_refused(digits_shards, tmp_path):
    premise, evil, marker = tmp_path / "PREMISE", tmp_path / "evil.ckpt", tmp_path / "MARKER"
    write_code_checkpoint(evil, premise)
    torch.load(evil, weights_only=False)  # what Lightning's _load does for URLs when weights_only is None
    assert premise.exists(), "the test file should run code when unpickled without weights_only"

    write_code_checkpoint(evil, marker)
    for weights_only in (None, False, True):  # whatever Lightning passes, the plugin loads weights only
        with pytest.raises(UserError, match="needs to run code to unpickle"):
            SafeCheckpointIO().load_checkpoint(evil, weights_only=weights_only)
    run = tmp_path / "run"
    proc = run_cli(*fit_args(digits_shards, run, "--ckpt_path", str(evil)), cwd=ROOT, check=False)
    assert_refused(proc, str(evil), marker, run)


def test_weights_only_defaults_to_true_and_false_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(RECIPES / "mpp.yaml"), "--print_config"])
    printed = capsys.readouterr().out
    assert "\nweights_only: true\n" in printed
    assert "class_path: ssl_vit.checkpoints.store.SafeCheckpointIO" in printed
    assert "save_last: link" in printed
    code = main(
        ["fit", "--config", str(RECIPES / "mpp.yaml"), "--weights_only", "false",
         "--trainer.default_root_dir", str(tmp_path)]
    )  # fmt: skip
    assert code == 2
    assert "ssl-vit: error: --weights_only false" in capsys.readouterr().err


def test_user_plugins_keep_the_checkpoint_io():
    from lightning_fabric.plugins.environments import LightningEnvironment
    from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    env = LightningEnvironment()
    plugins = store.with_safe_io([env])
    assert plugins[0] is env and isinstance(plugins[1], SafeCheckpointIO)
    wrapped = AsyncCheckpointIO()
    assert store.with_safe_io(wrapped) == [wrapped]
    assert isinstance(wrapped.checkpoint_io, SafeCheckpointIO)
    with pytest.raises(UserError, match="TorchCheckpointIO"):
        store.with_safe_io([TorchCheckpointIO()])


EVERY_STEP = {"filename": "step{step:07d}", "auto_insert_metric_name": False, "every_n_train_steps": 1}


def boring_fit(root: Path, callback, max_steps: int, ckpt_path=None) -> None:
    """Lightning's BoringModel, fitted quietly with ssl-vit's checkpoint IO and `callback`."""
    trainer = Trainer(
        max_steps=max_steps, callbacks=[callback], plugins=[SafeCheckpointIO()], logger=False,
        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)


class RecordRelinks(LastLinkCheckpoint):
    """Before each relink: does last.ckpt still load, and which step file still shares its data?"""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, list[str]]] = []

    def link_checkpoint(self, trainer, filepath: str, linkpath: str) -> None:
        if os.path.exists(linkpath):  # a dangling symlink does not exist
            inode = os.stat(linkpath).st_ino
            names = [p.name for p in Path(linkpath).parent.glob("step*.ckpt") if p.stat().st_ino == inode]
            self.seen.append((torch.load(linkpath, weights_only=True)["global_step"], names))
        super().link_checkpoint(trainer, filepath, linkpath)


def test_last_is_a_hard_link_and_rotation_keeps_the_previous_checkpoint(tmp_path):
    callback = RecordRelinks(**EVERY_STEP, dirpath=tmp_path)
    boring_fit(tmp_path, callback, max_steps=4)

    last, newest = tmp_path / "last.ckpt", tmp_path / "step0000004.ckpt"
    # save_top_k 1 keeps the previous checkpoint as well: last.ckpt is the newest one's data, and a
    # damaged file must leave an intact state to resume from.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step0000003.ckpt", "step0000004.ckpt"]
    assert not last.is_symlink() and last.stat().st_ino == newest.stat().st_ino and last.stat().st_nlink == 2
    # Each step saved step N+1 and removed step N-1 before relinking: last.ckpt (step N) still loaded.
    assert callback.seen == [(1, ["step0000001.ckpt"]), (2, ["step0000002.ckpt"]), (3, ["step0000003.ckpt"])]
    newest.unlink()  # and a hard link outlives the file it was made from
    assert torch.load(last, weights_only=True)["global_step"] == 4


def test_resuming_from_a_runs_first_checkpoint_keeps_one_last(tmp_path):
    def fit(max_steps: int, ckpt_path=None) -> None:
        boring_fit(tmp_path, LastLinkCheckpoint(**EVERY_STEP, dirpath=tmp_path), max_steps, ckpt_path)

    # Lightning records last_model_path in the state only when it writes last.ckpt, after the periodic
    # checkpoint; linked, the first checkpoint of a run would name no last.ckpt, and resuming from it
    # would link last-v1.ckpt and keep the old last.ckpt.
    fit(1)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1
    fit(3, ckpt_path="last")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step0000002.ckpt", "step0000003.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 3
    # The checkpoint's state names the previous one it kept: the next job rotates it away in turn.
    fit(5, ckpt_path="last")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step0000004.ckpt", "step0000005.ckpt"]


def test_link_falls_back_to_an_atomic_copy(tmp_path, monkeypatch):
    source, target = tmp_path / "step0000001.ckpt", tmp_path / "last.ckpt"
    SafeCheckpointIO().save_checkpoint({"state_dict": {"w": torch.arange(4)}}, source)
    target.write_bytes(b"previous")

    def no_hard_links(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(store.os, "link", no_hard_links)
    store.link_atomically(str(source), str(target))
    assert filecmp.cmp(source, target, shallow=False) and source.stat().st_ino != target.stat().st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step0000001.ckpt"]


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    SafeCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    before = target.read_bytes()

    def disk_full(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        SafeCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mpp", "supervised"])
def test_quickstart_fit_resumes_from_its_checkpoint(recipe, digits_shards, tmp_path):
    run, checkpoints = tmp_path / "run", tmp_path / "run/checkpoints"
    # The same checkpoint options both times: Lightning keys the callback's state by them.
    every_step = ["--checkpoint.every_n_train_steps", "1", "--checkpoint.save_top_k", "-1"]
    run_cli(*fit_args(digits_shards, run, "--trainer.max_steps", "3", *every_step, recipe=recipe), cwd=ROOT)
    saved = checkpoints / "step0000003.ckpt"
    checkpoint = torch.load(saved, weights_only=True, map_location="cpu")
    assert COMPLETE <= set(checkpoint) and checkpoint["global_step"] == 3
    first = {p.name: version(p) for p in checkpoints.iterdir()}

    proc = run_cli(
        *fit_args(digits_shards, run, "--trainer.max_steps", "5", *every_step, "--ckpt_path", str(saved),
                  recipe=recipe),
        cwd=ROOT,
    )  # fmt: skip
    assert f"Restored all states from the checkpoint at {saved}" in proc.stdout + proc.stderr
    # Steps 4 and 5 ran, not 1 to 5 again (those would be step000000N-v1.ckpt).
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["last.ckpt", *(f"step000000{n}.ckpt" for n in range(1, 6))]
    assert all(version(checkpoints / name) == first[name] for name in first if name != "last.ckpt")
    last = torch.load(checkpoints / "last.ckpt", weights_only=True, map_location="cpu")
    assert last["global_step"] == 5 and last["lr_schedulers"][0]["last_epoch"] == 5  # WarmupDecay went on
    assert {int(s["step"]) for s in last["optimizer_states"][0]["state"].values()} == {5}
    assert (checkpoints / "last.ckpt").samefile(checkpoints / "step0000005.ckpt")


# Runs `ssl-vit fit ARGV` in a forked child for each line read (a log path), printing the child's pid
# and then its wait status: the imports (5 s here) are paid once, not once per kill.
FORK_SERVER = r"""
import contextlib, io, json, os, sys, traceback
import pytorch_lightning  # its log handler binds sys.stderr on import: the real one, not the StringIO below
from ssl_vit.cli import main
argv, sys.argv = json.loads(sys.argv[1]), sys.argv[:1]
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        main([*argv, "--print_config"])  # imports every class the run resolves; no torch compute here
    except SystemExit:
        pass
print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        log = os.open(line.strip(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        try:
            code = main(argv)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    print(os.waitpid(pid, 0)[1], flush=True)
"""
# 12 kills: with the seed below, 7 aimed at a save and 5 at a random moment of a step (a step is mostly
# its save, so those often land in one too).
KILLS = 12


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkill_during_saves_leaves_loadable_checkpoints_and_resumes(digits_shards, tmp_path):
    run = tmp_path / "run"
    checkpoints, last = run / "checkpoints", run / "checkpoints/last.ckpt"
    # A checkpoint every step; width 256 and batch 4: a 40 MB checkpoint for little compute, so a save
    # is a sizeable part of a step. Each fit resumes from `last`, i.e. from where the previous was killed.
    argv = fit_args(
        digits_shards, run, "--checkpoint.every_n_train_steps", "1", "--data.init_args.batch_size", "4",
        "--model.init_args.backbone.width", "256", "--model.init_args.picture_every_n_steps", "0",
        "--ckpt_path", "last",
    )  # fmt: skip
    # $TMPDIR on another filesystem, as on clusters (node-local /tmp, shared checkpoint directory):
    # Lightning's save writes a temp file there, and shutil.move then *copies* it onto the checkpoint.
    tmpdir = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    server = subprocess.Popen(
        [sys.executable, "-c", FORK_SERVER, json.dumps(argv)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "TMPDIR": str(tmpdir)},
    )  # fmt: skip
    rng, pid, start = random.Random(1234), None, time.monotonic()
    mid_save, mid_link, resumed_from, stale, checked = 0, 0, 0, set(), set()
    resumable: set[Path] = set()  # the checkpoints of the highest step when the last fit was killed
    save_time = cycle = None

    def wait(until, what: str, kill: int, poll: float = 0.003) -> float:
        """Poll until `until()`; fail if the fit ends (its wait status arrives) or stalls."""
        deadline = time.monotonic() + 120
        while not until():
            if select.select([server.stdout], [], [], poll)[0] or time.monotonic() > deadline:
                log = (tmp_path / f"fit{kill}.log").read_text()[-3000:]
                pytest.fail(f"fit {kill} ended or stalled before {what}:\n{log}")
        return time.monotonic()

    def saving(names: set[str]) -> bool:
        """A name appeared since `names` (listed after the last save): the next save has begun. Not
        tied to how saves are written: a temp file here, the checkpoint itself in Lightning's."""
        return bool(set(os.listdir(checkpoints)) - names)

    try:
        assert server.stdout.readline().strip() == "ready"
        for kill in range(KILLS):
            log = tmp_path / f"fit{kill}.log"
            before = version(last)
            server.stdin.write(f"{log}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            t1 = wait(lambda before=before: version(last) not in (before, None), "its first save", kill)
            names = set(os.listdir(checkpoints))
            step = global_step(last)
            assert step > resumed_from, f"fit {kill} restarted at step {step}, not after {resumed_from}"
            if kill:  # the highest step saved: last.ckpt, or a step file a kill left newer than the link
                restored = re.search(r"Restored all states from the checkpoint at (\S+)", log.read_text())
                assert restored and Path(restored[1]) in resumable, log.read_text()[-2000:]
            assert not any((checkpoints / name).exists() for name in stale), "stale temp files stayed"
            if save_time is None:  # measured once: a step's length, and its save's (first file to link)
                saved = version(last)
                began = wait(lambda names=names: saving(names), "a second save", kill, poll=0)
                ended = wait(lambda saved=saved: version(last) != saved, "its end", kill, poll=0)
                cycle, save_time, names = ended - t1, ended - began, set(os.listdir(checkpoints))
            # Half the kills at a random moment of a step, half at a random moment of a save.
            if rng.random() < 0.5:
                time.sleep(rng.uniform(0, cycle))
            else:
                # Spinning, to catch the start of a save that may take only milliseconds.
                wait(lambda names=names: saving(names), "the next save", kill, poll=0)
                time.sleep(rng.uniform(0, save_time))
            os.kill(pid, signal.SIGKILL)
            status = int(server.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            pid = None

            names = sorted(os.listdir(checkpoints))
            temps = [name for name in names if not name.endswith(".ckpt")]
            assert all(TEMP_NAME.match(name) for name in temps), names  # hidden .NAME.HEX.tmp only
            mid_save += any(name.startswith(".step") for name in temps)
            mid_link += any(name.startswith(".last") for name in temps)
            stale = set(temps)
            assert [name for name in names if name.startswith("last")] == ["last.ckpt"], names
            for name in names:
                if name.endswith(".ckpt") and (name, version(checkpoints / name)) not in checked:
                    checkpoint = torch.load(checkpoints / name, weights_only=True, map_location="cpu")
                    assert COMPLETE <= set(checkpoint), f"{name}: {sorted(checkpoint)}"
                    checked.add((name, version(checkpoints / name)))
            # What --ckpt_path last resumes: the intact checkpoint of the highest recorded step.
            steps = {
                checkpoints / name: global_step(checkpoints / name)
                for name in names
                if name.endswith(".ckpt")
            }
            resumed_from = max(steps.values())
            resumable = {path for path, step in steps.items() if step == resumed_from}
        leftovers = sorted(p.name for p in tmpdir.iterdir() if p.is_file())  # wandb makes directories
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        server.kill()
        server.wait()
        shutil.rmtree(tmpdir, ignore_errors=True)
    print(
        f"\n{KILLS} kills in {time.monotonic() - start:.0f} s (step {cycle:.2f} s, save {save_time:.2f} s): "
        f"{mid_save} left a checkpoint's temp file (mid-save), {mid_link} a link's; at step {resumed_from}"
    )
    assert mid_save >= 3  # the kills did hit saves
    assert not leftovers, f"killed saves left files in $TMPDIR: {leftovers}"
