"""What a command prints: its own lines, Lightning's progress bar and final metrics, and where its W&B
run is, once (`tracking.WandbLogger`). Library messages that do not apply to how ssl-vit uses the
library are dropped by their exact text, each with the reason it does not apply; nothing is filtered
by module or category, so a new warning, or one that reports a real problem (skipped samples,
non-finite steps, a resume that cannot be exact, a compile that falls back), still shows.
`--verbose` or `SSL_VIT_VERBOSE=1` shows everything."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings

VERBOSE_ENV = "SSL_VIT_VERBOSE"
_WANDB_QUIETED = "SSL_VIT_QUIETED_WANDB"  # the W&B settings quiet() set: ours, not the user's
# W&B's informational lines: `quiet` drops the header and footer of a run (version, sync mode, local
# folder, viewer and sync hints), `show_info` its other `termlog` lines; warnings and errors still show
# (WANDB_SILENT would hide them too). `tracking.WandbLogger` says where the run is in one line instead.
_WANDB_QUIET = {"WANDB_QUIET": "true", "WANDB_SHOW_INFO": "false"}

# Python warnings, as regular expressions matching the start of their message.
WARNINGS = (
    # Lightning's SLURM check: srun is installed (a login node, a cluster image) but this process was not
    # started by it. ssl-vit's SLURM jobs start every task through srun (recipes/slurm/pretrain.sbatch);
    # a process outside srun is not a SLURM task, and the hint would only mislead.
    re.escape("The `srun` command is available on your system but is not used."),
    # Lightning's own pytree helper calls a torch API that torch deprecated; nothing a user can change.
    re.escape("`isinstance(treespec, LeafSpec)` is deprecated"),
    # The training stream's length is per rank and per epoch, and each worker delivers its exact share
    # (`ShardStream.share`), which is the case Lightning's warning says it cannot check.
    re.escape("Your `IterableDataset` has `__len__` defined."),
    # The frozen backbone of a linear probe, or the teacher of a masked task, is in eval mode on purpose.
    r"Found \d+ module\(s\) in eval mode at the start of training\.",
    # A fit refuses a run directory that holds checkpoints unless it resumes from one (`--ckpt_path`),
    # so a non-empty checkpoint directory is always the run's own.
    r"Checkpoint directory .* exists and is not empty\.",
    # `--ckpt_path last` in a run directory without checkpoints is a fresh start, as the README and the
    # SLURM script (which always passes it) say: the first job of a run.
    re.escape('.fit(ckpt_path="last") is set, but there is no last checkpoint available.'),
    # Every ssl-vit task validates when it is given val_urls; a run without them (a recipe that has no
    # validation split, `bench step`) skips the loop by design.
    re.escape("You defined a `validation_step` but have no `val_dataloader`. Skipping val loop."),
)

# Lightning's INFO lines, by their start: facts a user of ssl-vit either chose (the seed, the devices in
# the recipe) or cannot act on (an advertisement, a data loader being sized).
INFO_LINES = (
    "💡 Tip: For seamless cloud logging",
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "Seed set to",
    "Loading `train_dataloader` to estimate number of stepping batches.",
    "Restoring states from the checkpoint path at",  # "Restored all states from ..." follows, naming it too
)
INFO_LOGGERS = (
    "pytorch_lightning.utilities.rank_zero",
    "lightning_fabric.utilities.rank_zero",
    "lightning_fabric.utilities.seed",
)


# Hugging Face Hub's lines for each retry of a download (`timm:NAME` weights): the download either
# succeeds or ends in ssl-vit's one line naming the failure.
HUB_RETRY_LINES = re.compile(r"('.*'|HTTP Error \d+) thrown while requesting |Retrying in \d")
HUB_LOGGERS = ("huggingface_hub.utils._http", "huggingface_hub.hf_api", "huggingface_hub.file_download")


def verbose_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether `--verbose` (anywhere) or SSL_VIT_VERBOSE asks for everything, and argv without it."""
    verbose = "--verbose" in argv or os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    return verbose, [a for a in argv if a != "--verbose"]


def quiet(verbose: bool) -> None:
    """Drop the listed messages in this process and the processes it starts (DataLoader workers, DDP
    ranks started by Lightning or torchrun inherit the environment), unless `verbose`."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # ranks Lightning starts run `ssl-vit` again
        for name in os.environ.pop(_WANDB_QUIETED, "").split():  # an earlier quiet command's
            os.environ.pop(name, None)
        return
    for message in WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for names, drop in ((INFO_LOGGERS, _DropLines()), (HUB_LOGGERS, _DropLines(pattern=HUB_RETRY_LINES))):
        for name in names:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _DropLines) for f in logger.filters):
                logger.addFilter(drop)
    if not any(name in os.environ for name in (*_WANDB_QUIET, "WANDB_SILENT")):  # unless the user chose
        os.environ.update(_WANDB_QUIET)
        os.environ[_WANDB_QUIETED] = " ".join(_WANDB_QUIET)


class _DropLines(logging.Filter):
    """Drops the records whose message starts with one of `starts`, or that `pattern` matches."""

    def __init__(self, starts: tuple[str, ...] = INFO_LINES, pattern: re.Pattern | None = None):
        super().__init__()
        self.starts, self.pattern = starts, pattern

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if self.pattern is not None:
            return self.pattern.match(message) is None
        return not message.startswith(self.starts)


@contextlib.contextmanager
def lightning_info_dropped(*starts: str):
    """Lightning's INFO lines that start with `starts` dropped while the block runs (a trainer that is
    one step of a longer command, whose own display says where it is), unless verbose."""
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
        yield
        return
    drop = _DropLines(starts)
    loggers = [logging.getLogger(name) for name in INFO_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)
