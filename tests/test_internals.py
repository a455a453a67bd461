"""Canaries for `ssl_vit.internals`: every private attribute of Lightning, LightningCLI, torch and timm that
ssl-vit reaches is exercised here against the installed library, and a failure names the library's
version, the attribute and the function of `ssl_vit.internals` that reaches it (the one place to change
after an upgrade). The Lightning canaries share two tiny fits. And no other module of the package reaches
a private attribute of a library: the last tests grep it."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import io
import re
import signal
import sys
import tokenize
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loggers import WandbLogger
from pytorch_lightning.plugins.io import AsyncCheckpointIO
from pytorch_lightning.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.data import DataLoader

from ssl_vit import internals
from ssl_vit.internals import (
    CLASS_PATH_KEY,
    TOUCHES,
    LightningCLIHooks,
    ModelCheckpointHooks,
    RichProgressBarHooks,
    WandbLoggerHooks,
    accumulating,
    count_skipped,
    is_dataloader_sigchld_handler,
    logging_step,
    restart_fetcher,
    restore_step_counters,
    stop_as_on_sigterm,
    total_batch_idx,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ssl_vit"
COVERED: set[str] = set()


def canary(name: str):
    """Marks a test as the canary of `internals.<name>`: any failure in it becomes one line naming the
    library, its installed version, the attributes the function reaches and the function."""
    touch = TOUCHES[name]
    COVERED.add(name)

    def decorate(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            try:
                test(*args, **kwargs)
                return
            except (Exception, SystemExit) as err:  # (an AssertionError: there, but its use moved)
                failure = err
            version = importlib.import_module(touch.library).__version__
            gone = isinstance(failure, (AttributeError, ImportError, KeyError))
            what = "no longer exists" if gone else "no longer behaves as ssl-vit expects"
            pytest.fail(
                f"{touch.library} {version}: {', '.join(touch.attributes)} {what} "
                f"({type(failure).__name__}: {str(failure)[:300]}) (ssl_vit.internals.{name})",
                pytrace=False,
            )

        return run

    return decorate


# --- two tiny fits the Lightning canaries share ---------------------------------------------------------

BATCHES = 5  # an odd count: Lightning steps on the epoch's last batch whatever the accumulation


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        # batch i is a row of the value i: the canaries see which batch the loader gave
        rows = [torch.full((self.hparams.width,), float(i)) for i in range(BATCHES)]
        return DataLoader(rows, batch_size=None)


class Recording(ModelCheckpointHooks):
    """Which hooks Lightning called, in order, with the files' names."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple] = []

    def write_checkpoint(self, trainer, filepath: str) -> None:
        self.calls.append(("write", Path(filepath).name))
        super().write_checkpoint(trainer, filepath)

    def save_unmonitored(self, trainer, candidates) -> None:
        self.calls.append(("unmonitored", int(candidates["step"])))
        super().save_unmonitored(trainer, candidates)

    def find_last_checkpoints(self, trainer) -> set[str]:
        found = super().find_last_checkpoints(trainer)
        self.calls.append(("find_last", sorted(Path(p).name for p in found)))
        return found

    def link_checkpoint(self, trainer, filepath: str, linkpath: str) -> None:
        self.calls.append(("link", Path(filepath).name, Path(linkpath).name))
        super().link_checkpoint(trainer, filepath, linkpath)


class Outcomes:
    """What each touch gave inside a fit, or the error it raised (a raising touch must not end the fit
    that the other canaries share)."""

    def __init__(self) -> None:
        self.values: dict[str, list] = {}
        self.errors: dict[str, Exception] = {}

    def attempt(self, name: str, fn):
        try:
            value = fn()
        except Exception as err:
            self.errors.setdefault(name, err)
            return None
        self.values.setdefault(name, []).append(value)
        return value

    def of(self, name: str) -> list:
        if name in self.errors:
            raise self.errors[name]
        return self.values[name]


class Probe(pl.Callback):
    """Calls the touches from the hooks a fit of ssl-vit calls them from."""

    def __init__(self, outcomes: Outcomes, checkpoint: Recording, saved: Path) -> None:
        self.outcomes, self.checkpoint, self.saved = outcomes, checkpoint, saved

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        attempt = self.outcomes.attempt
        attempt("batches", lambda: int(batch[0]))
        stepping = not attempt("accumulating", lambda: accumulating(trainer))
        attempt("logging_step", lambda: (trainer.global_step, stepping, logging_step(trainer)))
        attempt("total_batch_idx", lambda: total_batch_idx(trainer))
        if batch_idx == 1:  # after the first optimizer step
            trainer.save_checkpoint(self.saved)
            # the loader starts again from its first batch, and the epoch counts 2 batches fetched
            attempt("restart_fetcher", lambda: restart_fetcher(trainer, fetched=2))

    def on_train_end(self, trainer, pl_module) -> None:
        ck, attempt = self.checkpoint, self.outcomes.attempt
        candidates = attempt("helpers", lambda: ck.monitor_candidates(trainer))
        if candidates is None:
            return
        extra = Path(ck.dirpath) / "extra.ckpt"
        extra.write_bytes(b"")
        attempt("helpers", lambda: int(candidates["step"]))
        best = ck.best_model_path
        attempt("helpers", lambda: ck.interpolated_name(candidates, trainer, best) == best)
        attempt("helpers", lambda: Path(ck.interpolated_name(candidates, trainer, None)).name)
        attempt("helpers", lambda: (ck.version_counter, ck.skips_saving(trainer)))
        attempt("helpers", lambda: (ck.should_remove(trainer, ck.best_model_path, ck.best_model_path),
                                    ck.should_remove(trainer, str(extra), ck.best_model_path)))  # fmt: skip
        attempt("helpers", lambda: ck.remove_checkpoint(trainer, str(extra)) or extra.exists())
        before = len(ck.calls)
        attempt("helpers", lambda: ck.save_topk(trainer, candidates) or ck.calls[before:])
        before = len(ck.calls)
        attempt("helpers", lambda: ck.save_last_checkpoint(trainer, candidates) or ck.calls[before:])


class StopAtFirstBatch(pl.Callback):
    def __init__(self, outcomes: Outcomes) -> None:
        self.outcomes = outcomes

    def on_train_start(self, trainer, pl_module) -> None:
        self.outcomes.attempt("resumed_at", lambda: trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.outcomes.attempt("stop_as_on_sigterm", lambda: stop_as_on_sigterm(trainer))

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.outcomes.attempt("exception", lambda: (type(exception), trainer.global_step))


def trainer(root: Path, callbacks: list, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        callbacks=callbacks, default_root_dir=root, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, accelerator="cpu",
        devices=1, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Fit 1: five batches, gradients accumulated over 2, the loader restarted after the second batch, a
    checkpoint at every step (a hard link as last.ckpt: `Recording`); afterwards the step counters are
    restored from the checkpoint of step 1, and 3 batches are counted as skipped. Fit 2 resumes with
    `ckpt_path="last"` and raises Lightning's SIGTERM flag at its first batch."""
    root = tmp_path_factory.mktemp("internals")
    outcomes, saved = Outcomes(), root / "saved-at-step1.ckpt"
    options = dict(
        dirpath=root / "checkpoints", every_n_train_steps=1, save_last="link", filename="step{step}",
        auto_insert_metric_name=False,
    )  # fmt: skip
    checkpoint = Recording(**options)
    probe = Probe(outcomes, checkpoint, saved)
    first = trainer(root, [probe, checkpoint], max_epochs=1, accumulate_grad_batches=2)
    first.fit(Tiny(width=3))
    outcomes.attempt("restored", lambda: restore_step_counters(first, torch.load(saved, weights_only=True)))
    outcomes.attempt("restored", lambda: (first.global_step, logging_step(first)))
    before = outcomes.attempt("count_skipped", lambda: total_batch_idx(first))
    outcomes.attempt("count_skipped", lambda: count_skipped(first, 3) or total_batch_idx(first) - before)

    resumed = Recording(**options)
    second = trainer(root, [StopAtFirstBatch(outcomes), resumed], max_epochs=3, max_steps=20)
    try:
        second.fit(Tiny(width=3), ckpt_path="last")
    except SIGTERMException:
        pass
    return SimpleNamespace(outcomes=outcomes, first=checkpoint, second=resumed, saved=saved, root=root)


@canary("accumulating")
def test_accumulating_is_true_between_optimizer_steps_and_false_on_the_last_batch(fits):
    assert fits.outcomes.of("accumulating") == [True, False, True, False, False]


@canary("restart_fetcher")
def test_a_restarted_fetcher_reads_from_the_start_and_ends_the_epoch_on_its_count(fits):
    assert fits.outcomes.of("restart_fetcher") == [None]
    assert fits.outcomes.of("batches") == [0, 1, 0, 1, 2]  # 2 fetched before, 3 after: the loader's 5


@canary("logging_step")
def test_the_logging_step_trails_the_global_step_after_an_optimizer_step(fits):
    for global_step, stepped, step in fits.outcomes.of("logging_step"):
        assert step == global_step - stepped
    assert [s for *_, s in fits.outcomes.of("logging_step")] == [0, 0, 1, 1, 2]


@canary("total_batch_idx")
def test_total_batch_idx_counts_the_runs_batches(fits):
    assert fits.outcomes.of("total_batch_idx") == [0, 1, 2, 3, 4]


@canary("restore_step_counters")
def test_the_step_counters_come_back_from_a_checkpoint(fits):
    read, (global_step, step) = fits.outcomes.of("restored")
    assert (read, global_step, step) == (2, 1, 0)  # saved after 2 batches and 1 step; logs at step 0 next


@canary("count_skipped")
def test_skipped_batches_count_as_the_runs_batches(fits):
    assert fits.outcomes.of("count_skipped")[1] == 3


@canary("stop_as_on_sigterm")
def test_the_sigterm_flag_stops_the_fit_after_the_current_step(fits):
    assert fits.outcomes.of("resumed_at") == [3]  # (and `ckpt_path="last"` found fit 1's last.ckpt)
    assert fits.outcomes.of("stop_as_on_sigterm") == [None]  # the flag, once: the fit ended there
    assert fits.outcomes.of("exception") == [(SIGTERMException, 4)]


@canary("ModelCheckpointHooks")
def test_lightning_calls_the_checkpoint_hooks_and_the_helpers_reach_its_steps(fits):
    for name in (
        "_save_checkpoint", "_save_none_monitor_checkpoint", "_find_last_checkpoints", "_link_checkpoint",
    ):  # fmt: skip
        getattr(ModelCheckpoint, name)  # the steps the hooks override
    calls = fits.first.calls
    assert calls[:3] == [("unmonitored", 1), ("write", "step1.ckpt"), ("link", "step1.ckpt", "last.ckpt")]
    assert [c[1] for c in calls if c[0] == "unmonitored"][:3] == [1, 2, 3]
    helpers = fits.outcomes.of("helpers")[1:]
    step, same, versioned, (counter, skips), (keep, remove), exists, topk, last = helpers
    assert step == 3 and same and versioned == "step3-v1.ckpt" and counter and skips
    assert (keep, remove, exists) == (False, True, False)
    assert topk == [("unmonitored", 3), ("write", "step3.ckpt")]
    assert last == [("link", "step3.ckpt", "last.ckpt")]
    assert ("find_last", ["last.ckpt"]) in fits.second.calls
    # Lightning has grown no public attribute of the hooks' names, which they would shadow
    public = [n for n, v in vars(ModelCheckpointHooks).items() if not n.startswith("_")]
    assert not [n for n in public if hasattr(ModelCheckpoint, n)]


@canary("RichProgressBarHooks")
def test_the_rich_bar_asks_the_hook_for_its_training_description():
    from pytorch_lightning.callbacks import RichProgressBar

    # Lightning's bar calls its private step where it draws the training bar
    assert "self._get_train_description(" in inspect.getsource(RichProgressBar)

    class Described(RichProgressBarHooks):
        def epoch_description(self, epoch: int) -> str:
            return f"{super().epoch_description(epoch)} (described)"

    bar = Described()
    bar._trainer = SimpleNamespace(max_epochs=5)  # what Lightning's description reads of the trainer
    assert bar._get_train_description(2).startswith(
        "Epoch 2/4"
    ) and "(described)" in bar._get_train_description(2)
    assert not [
        n
        for n, v in vars(RichProgressBarHooks).items()
        if not n.startswith("_") and hasattr(RichProgressBar, n)
    ]


@canary("wraps_checkpoint_io")
def test_async_checkpoint_io_is_a_wrapping_io():
    io = AsyncCheckpointIO()
    try:
        assert internals.wraps_checkpoint_io(io) and io.checkpoint_io is None
        assert not internals.wraps_checkpoint_io(pl.plugins.TorchCheckpointIO())
    finally:
        io.teardown()


@canary("WandbLoggerHooks")
def test_the_wandb_run_starts_with_the_options_and_is_kept_until_forgotten(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")  # (Lightning's `experiment` sets it for an offline run)
    started = []
    monkeypatch.setattr(wandb, "init", lambda **options: started.append(dict(options)) or SimpleNamespace())
    logger = WandbLoggerHooks(save_dir=str(tmp_path), project="p", id="abc", prefix="pre", offline=True)
    assert logger.metric_prefix == "pre" and logger.started_run is None
    assert logger.init_options["id"] == "abc" and logger.init_options["project"] == "p"
    logger.init_options["resume_from"] = "abc?_step=3"
    run = logger.experiment
    assert started == [logger.init_options] and logger.started_run is run
    logger.forget_run()
    assert logger.started_run is None and logger.experiment is not run and len(started) == 2
    public = [n for n, v in vars(WandbLoggerHooks).items() if not n.startswith("_")]
    assert not [n for n in public if hasattr(WandbLogger, n)]


class _Parsed(Exception):
    pass


class ProbeCLI(LightningCLIHooks):
    ready: dict
    parsed = False

    def __init__(self, args: list[str]) -> None:
        self.ready = {}
        super().__init__(Tiny, args=args, subclass_mode_model=True, trainer_defaults={"logger": False})

    def subcommands(self) -> dict[str, set[str]]:
        return {"fit": LightningCLI.subcommands()["fit"]}

    def subcommand_parser_ready(self, parser, subcommand: str, method_arguments: list[str]) -> None:
        self.ready[subcommand] = method_arguments
        parser.set_defaults(ckpt_path=None)

    def parse_ckpt_path(self) -> None:
        self.parsed = True
        super().parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        raise _Parsed(self)


@canary("LightningCLIHooks")
def test_the_cli_hooks_run_and_the_checkpoints_hyperparameters_reach_the_config(tmp_path, monkeypatch):
    for name in ("_prepare_subcommand_parser", "_parse_ckpt_path", "_parser"):
        getattr(LightningCLI, name)  # the steps the hooks override or call
    # What LightningCLI records of a model given by class path (ssl-vit's tasks): `_class_path` and the
    # constructor's arguments
    class_path = f"{Tiny.__module__}.{Tiny.__qualname__}"
    torch.save({"hyper_parameters": {CLASS_PATH_KEY: class_path, "width": 3}}, tmp_path / "tiny.ckpt")
    monkeypatch.setattr(sys, "argv", ["probe"])  # LightningCLI warns when given args beside sys.argv's
    with pytest.raises(_Parsed) as stopped:
        ProbeCLI(["fit", "--model", class_path, "--ckpt_path", str(tmp_path / "tiny.ckpt")])
    cli = stopped.value.args[0]
    assert "ckpt_path" in cli.ready["fit"] and cli.parsed
    model = cli.config.fit.model
    assert model.class_path == class_path and model.init_args.width == 3  # the checkpoint's, not 2
    assert cli.subcommand_parser(None) is cli.parser
    assert "trainer.max_steps" in internals.option_names(cli.subcommand_parser("fit"))
    public = [n for n, v in vars(LightningCLIHooks).items() if not n.startswith("_")]
    assert not [n for n in public if hasattr(LightningCLI, n)]


class Wide(Tiny):
    pass


@canary("CLASS_PATH_KEY")
def test_the_class_a_checkpoints_hyperparameters_name_is_the_model_rebuilt(tmp_path, monkeypatch):
    """LightningCLI's own key: a checkpoint of `Wide` resumed under `--model Tiny` rebuilds a `Wide`."""
    wide = f"{Wide.__module__}.{Wide.__qualname__}"
    torch.save({"hyper_parameters": {CLASS_PATH_KEY: wide, "width": 4}}, tmp_path / "wide.ckpt")
    tiny = f"{Tiny.__module__}.{Tiny.__qualname__}"
    monkeypatch.setattr(sys, "argv", ["probe"])  # LightningCLI warns when given args beside sys.argv's
    with pytest.raises(_Parsed) as stopped:
        ProbeCLI(["fit", "--model", tiny, "--ckpt_path", str(tmp_path / "wide.ckpt")])
    model = stopped.value.args[0].config.fit.model
    assert (model.class_path, model.init_args.width) == (wide, 4)
    assert CLASS_PATH_KEY not in model.init_args


@canary("option_names")
def test_option_names_lists_a_parsers_options_nested_ones_dotted():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Tiny, "model")
    assert {"model.width", "help"} <= set(internals.option_names(parser))


# --- torch -------------------------------------------------------------------------------------------


@canary("loss_scale")
def test_the_loss_scale_is_a_tensor_without_a_host_read():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    scale = internals.loss_scale(scaler)
    assert isinstance(scale, torch.Tensor) and float(scale) == 8.0


@canary("inductor_cudagraph_skips")
def test_inductor_still_counts_its_cudagraph_skips():
    assert isinstance(internals.inductor_cudagraph_skips(), int)
    # (counted only on a GPU: its inductor source still writes the counter)
    inductor = Path(importlib.util.find_spec("torch._inductor").origin).parent
    assert any('["cudagraph_skips"]' in p.read_text() for p in inductor.glob("*.py"))


@canary("is_dataloader_sigchld_handler")
def test_a_dataloader_with_workers_sets_the_handler_it_recognises(monkeypatch):
    from torch.utils.data._utils import signal_handling

    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (another test may have wrapped torch's)
    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", False)
    try:
        assert list(DataLoader(range(2), num_workers=1)) == [torch.tensor(0), torch.tensor(1)]
        assert is_dataloader_sigchld_handler(signal.getsignal(signal.SIGCHLD))
        assert not is_dataloader_sigchld_handler(previous if callable(previous) else None)
    finally:
        signal.signal(signal.SIGCHLD, previous)


# --- the registry, its docs, and no touch elsewhere --------------------------------------------------------


def test_every_touch_has_a_canary_and_a_line_in_the_docs():
    assert set(TOUCHES) == COVERED
    text = (ROOT / "docs" / "INTERNALS.md").read_text()
    assert not [name for name in TOUCHES if f"`{name}`" not in text]
    for touch in TOUCHES.values():
        assert not [a for a in touch.attributes if a not in text], touch


LIBRARIES = ("pytorch_lightning", "lightning_fabric", "lightning_utilities", "lightning", "torch", "timm",
             "jsonargparse", "argparse", "torchvision", "webdataset")  # fmt: skip
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # public, underscored
PRIVATE_MODULE = re.compile(rf"\b({'|'.join(LIBRARIES)})(\.\w+)*\._\w")
# Lightning's loops are private classes (`_FitLoop`, `_TrainingEpochLoop`) behind public attributes.
LOOPS = {"fit_loop", "epoch_loop"}
# Keys of Lightning's own in what it saves, named only through ssl_vit.internals.
PRIVATE_KEYS = {CLASS_PATH_KEY}
HINT = "go through ssl_vit.internals (or, for ssl-vit's own attribute, make it public)"


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name not in ("__main__.py", "internals.py"))


def _where(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def token_touches(path: Path) -> list[str]:
    """`x._name` outside `self._name`/`cls._name`, `from M import _name` of a library, strings naming a
    library's private module or Lightning's loops (docstrings aside), and the loops, in one file."""
    found, where, tree = [], _where(path), ast.parse(path.read_text())
    docstrings = {
        node.lineno for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str)
    }  # fmt: skip
    kept = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    tokens = [t for t in tokens if t.type not in kept]
    for i, tok in enumerate(tokens):
        line = f"{where}:{tok.start[0]}:"
        if tok.type == tokenize.NAME and i >= 2 and tokens[i - 1].string == ".":
            owner = tokens[i - 2].string
            own = owner in ("self", "cls") and (i < 3 or tokens[i - 3].string != ".")
            private = tok.string.startswith("_") and not tok.string.startswith("__")
            allowed = tok.string in NAMEDTUPLE_API or f"{owner}.{tok.string}" == "os._exit"
            if private and not own and not allowed:
                found.append(f"{line} `{owner}.{tok.string}` reaches a private attribute; {HINT}")
            if tok.string in LOOPS:
                found.append(f"{line} `.{tok.string}` is one of Lightning's private loops; {HINT}")
        if tok.type == tokenize.STRING and tok.start[0] not in docstrings:
            key = tok.string.strip("'\"") in PRIVATE_KEYS
            if key or PRIVATE_MODULE.search(tok.string) or re.search(r"\b(fit|epoch)_loop\b", tok.string):
                found.append(f"{line} {tok.string[:60]} names a library's private module or loop; {HINT}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in LIBRARIES:
            for alias in node.names:
                if alias.name.startswith("_"):
                    name = f"{node.module}.{alias.name}"
                    found.append(f"{where}:{node.lineno}: imports {name}, a private name; {HINT}")
    return found


def _library_class(value) -> bool:
    return inspect.isclass(value) and value.__module__.split(".")[0] in LIBRARIES


@functools.cache
def _library_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def class_touches(path: Path, module) -> list[str]:
    """Private names of a library base class (its methods and class attributes, and what its own code
    sets on `self`) that a class of `module` (the module at `path`) defines, or reaches on `self`, `cls`
    or `super()`."""
    found, where = [], _where(path)
    for node in ast.parse(path.read_text()).body:
        cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
        if not inspect.isclass(cls):
            continue
        libraries = [base for base in cls.__mro__[1:] if _library_class(base)]
        for name, line in _private_names(node):
            assigned = re.compile(rf"\bself\.{name}\b")
            if any(name in vars(base) or assigned.search(_library_source(base)) for base in libraries):
                found.append(f"{where}:{line}: {node.name} reaches {name} of a library base class; {HINT}")
    return found


def _private_names(node: ast.ClassDef):
    """(name, line) of the class's own methods and of its attributes on `self`, `cls` and `super()`
    whose names are private."""
    for child in ast.walk(node):
        name = None
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child in node.body:
            name = child.name
        elif isinstance(child, ast.Attribute):
            value = child.value
            if (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", "") == "super"
            ):
                name = child.attr
        if name and name.startswith("_") and not name.startswith("__"):
            yield name, child.lineno


def _module(path: Path):
    return importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))


def test_no_module_but_internals_reaches_a_private_attribute_of_a_library():
    found = [line for path in _sources() for line in token_touches(path)]
    assert not found, "\n".join(found)


def test_no_class_of_the_package_reaches_a_private_name_of_its_library_base():
    found = [line for path in _sources() for line in class_touches(path, _module(path))]
    assert not found, "\n".join(found)


PROBE = """\
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.callbacks import ModelCheckpoint
def f(trainer):
    return trainer.fit_loop._data_fetcher, "torch.utils.data._utils.x", trainer.fit_loop.epoch_loop
HPARAMS = {"_class_path": "x.Y"}
class C(ModelCheckpoint):
    def _save_checkpoint(self, trainer, filepath):
        return self._monitor_candidates(trainer), self._enable_version_counter, self._mine
"""


def test_the_checks_find_each_kind_of_touch(tmp_path):
    """The greps above find what they look for: one line of each kind, in a module written here."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    spec = importlib.util.spec_from_file_location("probe", probe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokens = "\n".join(token_touches(probe))
    for what in (
        "probe.py:1: imports lightning_fabric.utilities.types._PATH", "probe.py:4: `fit_loop._data_fetcher`",
        'probe.py:4: "torch.utils.data._utils.x"', "probe.py:4: `.epoch_loop`", 'probe.py:5: "_class_path"',
    ):  # fmt: skip
        assert what in tokens
    names = sorted(line.split(" reaches ")[1].split(" ")[0] for line in class_touches(probe, module))
    assert names == ["_enable_version_counter", "_monitor_candidates", "_save_checkpoint"]
