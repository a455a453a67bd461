"""Weights & Biases through Lightning's WandbLogger: offline unless the user opted in, one run per job
that a restarted job continues, and where the tasks' pictures go."""

from __future__ import annotations

import os
import sys
import uuid
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path

from pytorch_lightning.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torchvision.utils import save_image

from ssl_vit.errors import NO_ROOM, UserError
from ssl_vit.internals import WandbLoggerHooks, logging_step
from ssl_vit.redact import redacted

RUN_ID_FILE = "wandb-run-id"


def wandb_opted_in() -> bool:
    """True when the user chose a mode or has credentials; otherwise runs stay offline (no network)."""
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return bool(os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY")) or (
        netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    )


class WandbLogger(WandbLoggerHooks):
    """Lightning's WandbLogger with the defaults a cluster job needs.

    - Offline unless `WANDB_MODE`, `WANDB_API_KEY` or a wandb login says otherwise (`wandb sync`
      uploads an offline run later).
    - One W&B run per job: its id is kept in `save_dir/wandb-run-id`, and a job that resumes a
      checkpoint (SLURM requeue, `--ckpt_path last`) continues that run. `ssl-vit fit` passes the
      checkpoint's step as `resume_step`: the run is rewound to the last step the checkpoint holds
      (W&B's `resume_from`), so the steps a killed job logged after its last checkpoint are not kept
      twice; the resumed job logs them again (the same values, with exact resume). A job that starts
      afresh (`continue_run` false) starts a new run.
    - W&B's own step is the step Lightning logs at (`logging_step`; Lightning shows it only as
      `trainer/global_step`), so that the rewind point and every chart's x axis are the same number.
    - W&B's folder (`wandb/`) is in `save_dir`, or in W&B's own setting `WANDB_DIR` where that is set
      (Lightning passes `save_dir` to `wandb.init` as its `dir`, which would override it); config.yaml
      and the run id stay in `save_dir`. A folder W&B cannot write is one line naming it and the fixes.
    """

    def __init__(
        self,
        save_dir: str = "runs/default",
        project: str = "ssl-vit",
        name: str | None = None,
        id: str | None = None,  # noqa: A002 - wandb's own name for it
        offline: bool | None = None,
        log_model: bool = False,
        continue_run: bool = True,
        resume_step: int | None = None,
        **kwargs,
    ) -> None:
        id_file = Path(save_dir) / RUN_ID_FILE
        if id is None and continue_run and id_file.is_file():
            id = id_file.read_text().strip()
        if id is None:
            id = uuid.uuid4().hex[:8]  # wandb's own ids are 8 lowercase alphanumerics too
        # Written once the W&B run exists (`experiment`): a job that fails before it started keeps the
        # run directory's id, so the next resume still continues the run it belongs to.
        self._id_to_save: tuple[Path, str] | None = (id_file, id)
        offline = (not wandb_opted_in()) if offline is None else offline
        # LightningCLI passes every wandb.init option, unset ones as None: a resume option the user set
        # wins; otherwise the run id decides.
        chosen = {k: kwargs.pop(k) for k in ("resume", "resume_from", "fork_from") if k in kwargs}
        resume = {k: v for k, v in chosen.items() if v is not None} or {"resume": "allow"}
        if continue_run and resume_step is not None and not any(v is not None for v in chosen.values()):
            # A checkpoint of step k holds k optimizer steps, whose metrics went to W&B steps 0 ... k-1
            # (`logging_step`); W&B keeps the step it rewinds to and takes only later ones, so the rewind
            # is to k-1: the resumed job's first batch logs at k.
            rewind = max(resume_step - 1, 0)
            resume = {"resume": None, "resume_from": f"{id}?_step={rewind}"}  # Lightning sets resume
        super().__init__(
            save_dir=save_dir,
            project=project,
            name=name,
            id=id,
            offline=offline,
            log_model=log_model,
            **resume,
            **kwargs,
        )
        self._floor = -1  # steps at or before it are not logged (`rewind`)
        if os.environ.get("WANDB_DIR"):
            self.init_options["dir"] = os.environ["WANDB_DIR"]
        # Lightning passes `anonymous` to wandb.init even when unset, and W&B warns on every run that
        # the setting is deprecated
        if self.init_options.get("anonymous") is None:
            self.init_options.pop("anonymous", None)

    @property
    def experiment(self):
        if self._id_to_save is not None and rank_zero_only.rank == 0:
            # W&B looks for a git repository from its directory as it starts, and warns that the
            # directory does not exist when the run directory is not made yet
            self._id_to_save[0].parent.mkdir(parents=True, exist_ok=True)
        try:
            run = super().experiment
        except OSError as err:
            if err.errno in NO_ROOM:  # the machine's: the CLI's line for a full disk
                raise
            folder = Path(self.init_options.get("dir") or ".") / "wandb"
            raise UserError(
                f"W&B cannot write its run in {folder} ({type(err).__name__}: {err.strerror or err}): "
                "make it a directory this user can write, give W&B another one (WANDB_DIR=DIR), or run "
                "without W&B (--trainer.logger false)"
            ) from None
        if self._id_to_save is not None and rank_zero_only.rank == 0:  # only rank 0 creates the run
            id_file, run_id = self._id_to_save
            id_file.write_text(run_id + "\n")
            self._id_to_save = None
            print(f"W&B: {where(run)}", file=sys.stderr)
        return run

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        # The run ends with its trainer. Lightning leaves it open to the interpreter's exit, where W&B's
        # service prints the run's footer (the sync hint, the log folder) even when W&B is set to be
        # quiet; finished here, the footer follows the setting.
        run = self.started_run
        if run is not None and getattr(run, "finish", None) is not None:
            run.finish(exit_code=0 if status == "success" else 1)

    @rank_zero_only
    def rewind(self, step: int) -> None:
        """Continues the run from optimizer step `step` (a rollback to a checkpoint of that step, in this
        job), as a resume from that checkpoint does: the run is finished and started again with W&B's
        `resume_from` at `step - 1` (the metrics logged at steps 0 ... step-1 are the checkpoint's), so
        what was logged after it is dropped and the steps are logged again. Values logged at those kept
        steps until training reaches `step` again (the rolled-back step's own) are not logged."""
        rewind = max(step - 1, 0)
        if self.started_run is not None:
            self.started_run.finish()
            self.forget_run()  # started again by `experiment` at the next log
        self.init_options.pop("fork_from", None)
        self.init_options.update(resume=None, resume_from=f"{self.init_options['id']}?_step={rewind}")
        self._floor = step - 1

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        """Lightning's, with every credential in the values hidden (`ssl_vit.redact`): the run's config
        leaves the machine (a shard URL's password, a presigned checkpoint URL's signature)."""
        if isinstance(params, Mapping):
            params = redacted(dict(params))
        elif isinstance(params, Namespace):
            params = redacted(vars(params))
        super().log_hyperparams(params, *args, **kwargs)

    @rank_zero_only
    def log_metrics(self, metrics, step: int | None = None) -> None:
        if step is not None and step <= self._floor:
            return
        if step is None:
            return super().log_metrics(metrics, step)
        if self.metric_prefix:
            metrics = {f"{self.metric_prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        self.experiment.log({**metrics, "trainer/global_step": step}, step=step)


def where(run) -> str:
    """Where a W&B run is, in a few words: its page, or its offline folder and how to upload it."""
    settings = getattr(run, "settings", None)
    if settings is None:  # not a wandb Run (a stand-in)
        return str(run)
    if getattr(run, "offline", False) or not getattr(run, "url", None):
        folder = settings.sync_dir
        if not os.path.relpath(folder).startswith(".."):  # under the working directory: shorter
            folder = os.path.relpath(folder)
        return f"offline run in {folder} (upload: wandb sync {folder})"
    return str(run.url)


def log_picture(module, key: str, image: Tensor) -> None:
    """Send a (3, H, W) picture in [0, 1] to every logger that takes images (W&B), at the step of the
    batch it shows (call it from `on_train_batch_end`), and save it as a PNG under the run directory,
    `pictures/`, so it can be looked at without W&B."""
    step = logging_step(module.trainer)
    out = Path(module.trainer.default_root_dir) / "pictures" / f"{key.replace('/', '_')}_{step:07d}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(image, out)
    for logger in module.loggers:
        if hasattr(logger, "log_image"):
            logger.log_image(key=key, images=[image.permute(1, 2, 0).cpu().numpy()], step=step)
