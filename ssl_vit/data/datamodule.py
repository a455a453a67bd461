"""`ShardDataModule`: WebDataset shards -> batches for Lightning, on one device or many.

    data:
      class_path: ssl_vit.data.ShardDataModule
      init_args:
        train_urls: data/shards/digits/train-{000000..000001}.tar
        val_urls: data/shards/digits/val-000000.tar
        batch_size: 64
        image_size: 32

Training reads a resampled stream with a fixed number of batches per rank per epoch; validation and
test are exact passes (see `ssl_vit.data.stream`). Batches reach the model as dicts: `image` float
[B,3,H,W] (normalised; the DataLoaders give uint8, converted on the device by `prepare_batch`),
`label` int64 [B] (-1 where unlabelled), `key` list[str], `skipped` (bad samples the batch's worker
dropped since its previous batch), during training `stream` (the position of the batch's worker, which
makes the training DataLoader resumable mid-epoch: `EpochLoader`), and with mixup/cutmix/label
smoothing also `target` float [B,K] (timm's soft targets).

Remote shards and manifests are read with retries and a read timeout (`read_retries`,
`read_timeout_s`: `ssl_vit.data.remote`); a DataLoader whose workers deliver no batch for
`loader_timeout_s` ends the run with one line naming the split's shards (`ShardLoader`). Each split's
manifest is read once per data module (`manifests`), so the epoch size, the class count and the eval
view all come from one reading.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Collection
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, Mixup
from timm.data.mixup import mixup_target
from torch.utils.data import DataLoader

from ssl_vit.data.device_decode import device_transform, place_jpegs
from ssl_vit.data.identity import changes, identity
from ssl_vit.data.remote import ReadPolicy
from ssl_vit.data.stream import ResumePlan, ShardStream, WorkerPosition
from ssl_vit.data.transforms import EvalView, Preset, build_transform, normalize
from ssl_vit.data.urls import check_urls, expand, manifest_url, read_manifest
from ssl_vit.errors import BadValue, UserError

log = logging.getLogger("ssl_vit.data")


class ShardLoader(DataLoader):
    """A DataLoader of a `ShardStream` (`batch_size=None`) that ends the run with one line naming the
    split's shards when its workers deliver no batch for `timeout` seconds, rather than wait for ever
    on a stalled server or a stuck worker.

    The wait is torch's DataLoader `timeout`, which applies with workers only; its RuntimeError becomes
    a UserError here, and the workers are stopped at once (`_Workers`), not left to outlive the run.
    Without workers the main process reads the shards itself, and every remote read times out on its
    own (`read_timeout_s`)."""

    def __init__(self, stream: ShardStream, *, split: str, timeout: float, num_workers: int, **kwargs):
        workers = _Workers(num_workers)
        super().__init__(
            stream,
            batch_size=None,
            num_workers=num_workers,
            timeout=timeout if num_workers else 0,
            # A generator of its own: creating an iterator draws the workers' base seed from it rather
            # than from the global torch RNG, which belongs to the model (masks, dropout) and is part of
            # exact resume. The workers seed every random choice themselves (`ssl_vit.data.stream`).
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=workers.start,
            **kwargs,
        )
        self.split, self.wait_s, self.workers = split, timeout, workers

    def __iter__(self):
        self.workers.reset()
        iterator = super().__iter__()
        _DeadWorkers.watch()
        return _Watched(iterator, self)

    def timed_out(self) -> UserError:
        """The one line for no batch in `timeout` seconds; the workers are stopped first."""
        self.workers.stop()
        urls = self.dataset.urls
        shown = ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")
        return UserError(
            f"no batch from the {self.num_workers} DataLoader worker(s) in {self.wait_s:g} s while reading "
            f"{self.split}_urls ({shown}): their server stalls or cannot be reached, or a worker is stuck; "
            "check the shards (`ssl-vit data inspect`) or raise data.init_args.loader_timeout_s"
        )


class _DeadWorkers:
    """When torch reports a dead DataLoader worker: from inside `next`, between two steps.

    Torch's SIGCHLD handler (set by the first iterator with workers) raises a dead worker's error
    wherever the main thread is when the worker dies: in the middle of a step, between an optimizer's
    updates, where the run's state cannot be saved. Wrapped here (`watch`), it raises at once only while
    the main thread waits in a loader's `next` (a batch of the dead worker would never come), and
    otherwise keeps the error for the next `next`, which raises it before fetching (`_Watched`). Either
    way the error leaves `next` marked `at_batch_boundary`, and `ssl_vit.tasks.preemption` saves there."""

    in_next = False
    pending: BaseException | None = None

    @classmethod
    def watch(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        torch_handler = signal.getsignal(signal.SIGCHLD)
        if getattr(torch_handler, "__module__", "") != "torch.utils.data._utils.signal_handling":
            return  # not set (no workers), or wrapped already

        def handler(signum, frame):
            try:
                torch_handler(signum, frame)
            except RuntimeError as err:
                if cls.in_next:
                    raise
                cls.pending = err

        signal.signal(signal.SIGCHLD, handler)

    @classmethod
    def fetch(cls, iterator):
        """`next(iterator)`, or the error of a worker that died since the last fetch."""
        try:
            if cls.pending is not None:
                err, cls.pending = cls.pending, None
                raise err
            cls.in_next = True
            try:
                return next(iterator)
            finally:
                cls.in_next = False
        except RuntimeError as err:
            err.at_batch_boundary = True
            raise


class _Watched:
    """A DataLoader iterator whose timeout is its loader's one-line error (`ShardLoader`)."""

    def __init__(self, iterator, loader: ShardLoader):
        self.iterator, self.loader = iterator, loader

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return _DeadWorkers.fetch(self.iterator)
        except RuntimeError as err:
            if not str(err).startswith("DataLoader timed out"):
                raise
            raise self.loader.timed_out() from None

    def __len__(self) -> int:
        return len(self.iterator)


class EpochLoader(ShardLoader):
    """The training DataLoader: hands its stream the epoch (and, once after a resume, where each worker
    stands) before starting workers, and keeps track of the batches training consumed.

    With non-persistent workers the dataset is copied into fresh workers on every `iter()`, so this is
    where the main process can tell them; Lightning only calls `set_epoch` on samplers, which a
    DataLoader over an IterableDataset does not have. What is tracked is the position of the batches
    training consumed (`record`, called by the datamodule for every training batch), not of those
    fetched: Lightning fetches one batch ahead.
    """

    def __init__(self, stream: ShardStream, start: Callable[[], tuple[int, ResumePlan | None]], **kwargs):
        super().__init__(stream, split="train", persistent_workers=False, **kwargs)
        self.start = start
        self.epoch: int | None = None
        self.consumed: dict[int, WorkerPosition] = {}

    def __iter__(self):
        epoch, plan = self.start()
        self.dataset.epoch, self.dataset.resume = epoch, plan
        self.epoch, self.consumed = epoch, dict(plan.workers) if plan else {}
        return super().__iter__()

    def record(self, batch: dict) -> None:
        """Note that training consumed `batch` (it carries its worker's position in `stream`)."""
        worker, batches, segment, offset = (int(v) for v in batch["stream"])
        self.consumed[worker] = WorkerPosition(batches, segment, offset)

    # Lightning's Stateful-loader protocol: it warns that a resume in the middle of an epoch is not
    # exact unless the training loader has these. Where the stream stands is the data module's state
    # (`ShardDataModule.state_dict`), which makes the resume exact, or says why it cannot be.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass

    def position(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "num_workers": max(1, self.num_workers),
            "workers": {w: [p.batches, p.segment, p.offset] for w, p in self.consumed.items()},
        }


# How long a DataLoader worker outlives a SIGTERM: long enough for its main process to finish the step
# and save (it stops its workers itself), bounded so that a worker whose main process never stops it
# (e.g. a leaked iterator at interpreter exit, which terminates daemonic children with SIGTERM) ends.
# SSL_VIT_WORKER_GRACE_S sets it (a cluster whose jobs need longer between SIGTERM and SIGKILL; tests).
WORKER_SIGTERM_GRACE_S = int(os.environ.get("SSL_VIT_WORKER_GRACE_S", "60"))


class _Workers:
    """How a DataLoader's workers take job signals, and how its main process stops them at once.

    SLURM signals every process of a job step, DataLoader workers included. A worker killed by SIGUSR1
    or SIGTERM would make the main process fail at once (torch raises from its SIGCHLD handler) before
    it could save; the main process decides what the signal means (`ssl_vit.tasks.preemption`) and
    stops its workers itself. So a worker (`start`, its `worker_init_fn`) ignores SIGUSR1, and ends
    WORKER_SIGTERM_GRACE_S seconds after a SIGTERM (SIGALRM's default action) unless it was stopped
    before; but once its main process has given up on it (`stop`: no batch within the timeout), a
    SIGTERM ends it at once, with status 0 (which torch's SIGCHLD handler takes for a normal end), so
    that a worker stuck in a read does not keep the ending process alive for the grace period.

    Shared memory (the workers' pids, the flag) because a worker's signal handler cannot ask its main
    process anything, and torch gives no public way to the pids of an iterator's workers."""

    def __init__(self, num_workers: int):
        self.pids = multiprocessing.RawArray("i", max(1, num_workers))
        self.stopping = multiprocessing.RawValue("b", 0)
        _LIVE.add(self)

    def reset(self) -> None:
        """Before an iterator starts its workers."""
        self.pids[:] = [0] * len(self.pids)
        self.stopping.value = 0

    def start(self, worker_id: int) -> None:
        self.pids[worker_id] = os.getpid()
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        sys.excepthook = functools.partial(self._excepthook, sys.excepthook)

    def _on_sigterm(self, signum, frame) -> None:
        self.terminated = True
        if self.stopping.value:
            os._exit(0)
        signal.alarm(WORKER_SIGTERM_GRACE_S)

    def _excepthook(self, previous, kind, value, traceback) -> None:
        """In a worker: once the job is stopping (a SIGTERM came, or the main process gave up on it),
        a connection its main process has closed (multiprocessing's file-descriptor sharing thread
        reports it through `sys.excepthook`) is a consequence of the stop, not news."""
        stopping = self.stopping.value or getattr(self, "terminated", False)
        if not (stopping and issubclass(kind, (ConnectionError, EOFError))):
            previous(kind, value, traceback)

    def stop(self) -> None:
        """In the main process: end the current iterator's workers now (only processes that are still
        this process's children: a finished iterator's pids may belong to anyone by now)."""
        self.stopping.value = 1
        children = {child.pid for child in multiprocessing.active_children()}
        for pid in self.pids:
            if pid in children:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


# Every data loader's workers of this process, for `stop_all_workers`.
_LIVE: weakref.WeakSet[_Workers] = weakref.WeakSet()


def stop_all_workers() -> None:
    """End every DataLoader worker of this process now: for a run that has saved and is stopping
    (SIGTERM), whose workers would otherwise sit out their grace period, the process waiting for them
    at exit."""
    for workers in list(_LIVE):
        workers.stop()


SPLITS = ("train", "val", "test")
# The split each stage cannot run without.
REQUIRED_SPLIT = {"fit": "train", "validate": "val", "test": "test"}
# The splits each stage reads.
STAGE_SPLITS = {"fit": ["train", "val"], "validate": ["val"], "test": ["test"], None: list(SPLITS)}


def check_required_urls(stage: str | None, urls: dict[str, Any]) -> None:
    """One line if the split `stage` reads has no URLs. `urls`: `train_urls`, `val_urls`, `test_urls` as
    configured (a datamodule's own, or the command line's, checked before the trainer starts)."""
    split = REQUIRED_SPLIT.get(stage)
    if split is not None and f"{split}_urls" in urls and urls[f"{split}_urls"] is None:
        raise UserError(
            f"{split}_urls is not set: give the URLs of the {split} shards (data.init_args.{split}_urls)"
        )


def check_shard_urls(
    stage: str | None, urls: dict[str, Any], policy: ReadPolicy | None = None
) -> dict[str, list[str]]:
    """The brace-expanded URLs of the splits `stage` reads, each shard checked (`check_urls`, remote ones
    with `policy`; by default the one `urls` sets, see `read_policy`): one line for a split without URLs
    or a shard that is missing. `urls` as for `check_required_urls`."""
    check_required_urls(stage, urls)
    policy = policy or read_policy(urls)
    expanded = {}
    for split in STAGE_SPLITS.get(stage, []):
        if urls.get(f"{split}_urls") is not None:
            expanded[split] = expand(urls[f"{split}_urls"], f"{split}_urls")
            check_urls(expanded[split], f"{split}_urls", policy)
    return expanded


def read_policy(args: dict[str, Any]) -> ReadPolicy:
    """The `ReadPolicy` of a data module's arguments (`read_retries`, `read_timeout_s`; the defaults
    for those `args` leaves out), checked first."""
    values = {key: args[key] for key in ("read_retries", "read_timeout_s") if args.get(key) is not None}
    check_counts({k: v for k, v in values.items() if k in COUNT_MINIMUMS})
    check_seconds({k: v for k, v in values.items() if k in SECONDS})
    return ReadPolicy(
        retries=values.get("read_retries", DEFAULT_READ.retries),
        timeout_s=float(values.get("read_timeout_s", DEFAULT_READ.timeout_s)),
    )


# The integer settings of a `ShardDataModule` and their smallest values (None: the default applies).
COUNT_MINIMUMS = {
    "batch_size": 1, "image_size": 1, "num_workers": 0, "segment_shards": 1, "train_batches": 1,
    "num_classes": 1, "seed": 0, "read_retries": 0,
}  # fmt: skip
# Its settings in seconds: positive, finite numbers (None: the default applies).
SECONDS = ("read_timeout_s", "loader_timeout_s")
DEFAULT_READ = ReadPolicy()


def check_counts(values: dict[str, Any], where: str = "") -> None:
    """One line for an integer setting (`COUNT_MINIMUMS`) that is not an integer or is too small;
    `where` prefixes it (a suite file's data block)."""
    for key, value in values.items():
        low = COUNT_MINIMUMS[key]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise BadValue(f"{where}{key} is {value!r}: it should be an integer of at least {low}")


def check_seconds(values: dict[str, Any], where: str = "") -> None:
    """One line for a setting in seconds (`SECONDS`) that is not a positive, finite number."""
    for key, value in values.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and 0 < value < math.inf):
            raise BadValue(f"{where}{key} is {value!r}: it should be a positive number of seconds")


class ShardDataModule(pl.LightningDataModule):
    """Streams WebDataset shards: resampled training streams, exact validation/test passes.

    Args:
        train_urls, val_urls, test_urls: shard URLs (brace ranges; local paths, `file://`, `http(s)://`,
            `pipe:CMD`, fsspec URLs such as `s3://`), a string or a list.
        batch_size: samples per batch per device.
        num_workers: DataLoader worker processes per device.
        image_size: side of the square crops fed to the model.
        train_preset: training transform (`pretrain`, `supervised` or `eval`); val/test always use `eval`.
        crop_scale: area range of the random resized crop.
        randaugment: timm RandAugment config such as `rand-m9-mstd0.5-inc1` (`supervised` preset only).
        mixup_alpha, cutmix_alpha, label_smoothing: timm `Mixup` on training batches, on the device;
            they add a soft `target` [B, num_classes] to the batch.
        eval_crop_pct: `eval` resizes the shorter side to `image_size / eval_crop_pct`, then centre-crops,
            unless the split's images are stored at `image_size` (`eval_view`): those are taken whole.
        train_batches: batches per rank per epoch; by default the manifest's sample count (after the
            class filter) divided by `batch_size * world_size`.
        shuffle_buffer: samples in the raw-bytes shuffle buffer of each training worker.
        segment_shards: a training worker draws its shards in segments of this many, each shuffled on
            its own; a resumed run re-reads (without decoding) at most one segment per worker to get
            back to where it stopped (`ssl_vit.data.stream`).
        seed: seed of every training stream; the stream is a function of (seed, epoch, rank, worker).
        classes: keep only samples with these labels (labels are not renumbered).
        train_keys: keep only the training split's samples with these `__key__`s (a labelled subset,
            drawn within `classes`); the other splits are not filtered. The stream still reads every
            shard and decodes only the kept samples.
        num_classes: overrides the manifest's class count.
        mean, std: normalisation.
        draft: decode JPEGs at a reduced scale (1/2, 1/4, 1/8) when the crop's source region, or for
            `eval` the whole image, stays at least the size it is resized to.
        decode: where training JPEGs are decoded. `cpu`: in the DataLoader workers. `device`: the workers
            read the tars and draw each crop box and flip from the JPEG's header (the same draws as
            `cpu`), and the batch is decoded, cropped, resized and flipped on the device it is moved to
            (`ssl_vit.data.device_decode`), which frees the workers' cores; other formats, CMYK JPEGs and
            JPEGs the device refuses are decoded on the CPU, counted (`data/decoded_on_cpu_train`).
            Random-resized-crop presets (`pretrain`, `supervised` without RandAugment) only;
            validation and test are decoded on the CPU.
        read_retries: a remote shard, manifest or shard check (http(s), fsspec, `pipe:`) that fails is
            tried this many more times, waiting 1 s, 2 s, 4 s, ... (at most 30 s) between tries; a shard
            that still fails is skipped and counted, a manifest that still fails stops the run.
        read_timeout_s: a remote read that gets no byte for this long has failed (and is retried).
        on_data_change: a resume whose training shards or manifest differ from the checkpoint's
            (`ssl_vit.data.identity`) cannot be exact: `warn` says so in one line and goes on, `refuse`
            stops with that line.
        loader_timeout_s: with DataLoader workers, no batch for this long ends the run with one line
            naming the split's shards; by default twice the longest a shard read can take before it
            gives up (every try timing out: 782 s with the defaults above).
    """

    def __init__(
        self,
        train_urls: str | list[str] | None = None,
        val_urls: str | list[str] | None = None,
        test_urls: str | list[str] | None = None,
        batch_size: int = 64,
        num_workers: int = 4,
        image_size: int = 224,
        train_preset: Preset = "pretrain",
        crop_scale: tuple[float, float] = (0.08, 1.0),
        randaugment: str | None = None,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        label_smoothing: float = 0.0,
        eval_crop_pct: float = 0.875,
        train_batches: int | None = None,
        shuffle_buffer: int = 2000,
        segment_shards: int = 4,
        seed: int = 0,
        classes: list[int] | None = None,
        train_keys: Collection[str] | None = None,
        num_classes: int | None = None,
        mean: tuple[float, float, float] = IMAGENET_DEFAULT_MEAN,
        std: tuple[float, float, float] = IMAGENET_DEFAULT_STD,
        draft: bool = True,
        decode: Literal["cpu", "device"] = "cpu",
        read_retries: int = 5,
        read_timeout_s: float = 60.0,
        loader_timeout_s: float | None = None,
        on_data_change: Literal["warn", "refuse"] = "warn",
    ):
        super().__init__()
        # No save_hyperparameters: the CLI logs the whole config (data included) to W&B, and Lightning
        # refuses to log a datamodule's hparams that share a key (num_classes) with the model's.
        check_counts(
            {
                "batch_size": batch_size, "image_size": image_size, "num_workers": num_workers,
                "segment_shards": segment_shards, "train_batches": train_batches, "num_classes": num_classes,
                "seed": seed,
            }
        )  # fmt: skip
        check_seconds({"loader_timeout_s": loader_timeout_s})
        low, high = crop_scale
        if not 0 < low <= high <= 1:
            raise BadValue(
                f"crop_scale {list(crop_scale)}: give the random crop's area range as two fractions of the "
                "image, 0 < min <= max <= 1 (e.g. [0.2, 1.0])"
            )
        if decode not in ("cpu", "device"):
            raise BadValue(f"decode must be 'cpu' or 'device', got {decode!r}")
        if decode == "device" and (train_preset == "eval" or randaugment):
            raise BadValue(
                "decode 'device' decodes the random-resized-crop presets ('pretrain', 'supervised' without "
                "randaugment), whose crop it draws before decoding; "
                + ("RandAugment works on PIL images" if randaugment else "'eval' resizes whole images")
                + ": use decode 'cpu'"
            )
        self.read_policy = read_policy({"read_retries": read_retries, "read_timeout_s": read_timeout_s})
        self.loader_timeout_s = loader_timeout_s or 2 * self.read_policy.worst_case_s()
        if (mixup_alpha or cutmix_alpha) and train_preset != "supervised":
            raise BadValue(f"mixup/cutmix belong to train_preset 'supervised', not {train_preset!r}")
        # build once to validate the preset/randaugment combination at construction time
        build_transform(
            train_preset,
            image_size,
            mean=mean,
            crop_scale=crop_scale,
            randaugment=randaugment,
            crop_pct=eval_crop_pct,
        )
        self.train_urls, self.val_urls, self.test_urls = train_urls, val_urls, test_urls
        self.batch_size, self.num_workers, self.image_size = batch_size, num_workers, image_size
        self.train_preset, self.crop_scale, self.randaugment = train_preset, tuple(crop_scale), randaugment
        self.mixup_args = {
            "mixup_alpha": mixup_alpha,
            "cutmix_alpha": cutmix_alpha,
            "label_smoothing": label_smoothing,
        }
        self.eval_crop_pct = eval_crop_pct
        self.train_batches = train_batches
        self.batches_per_epoch: int | None = None  # per rank, known at setup
        self.shuffle_buffer = shuffle_buffer
        self.segment_shards = segment_shards
        self._train_loader: EpochLoader | None = None
        self._resume: dict | None = None  # a restored position, used by the next training pass
        self.seed = seed
        self.classes = list(classes) if classes is not None else None
        self.train_keys = frozenset(train_keys) if train_keys is not None else None
        self._num_classes = num_classes
        self.mean, self.std = tuple(mean), tuple(std)
        self.draft, self.decode = draft, decode
        self.epoch = 0
        self.rank, self.world_size = 0, 1
        self._urls: dict[str, list[str]] = {}
        # Manifests read, by URL (None: there is none), each once: another data module of the same run
        # may share this dict (evaluation's trained protocols, the few-shot monitor) so that both decide
        # from one reading.
        self.manifests: dict[str, dict | None] = {}
        self._views: dict[str, EvalView] = {}
        self.on_data_change = on_data_change
        self._mixup: Mixup | None = None
        self._check_labels()

    # --- facts for linking (LightningCLI link_arguments) --------------------------------------------

    @property
    def manifest(self) -> dict | None:
        """The manifest of the first configured split that has one."""
        for urls in (self.train_urls, self.val_urls, self.test_urls):
            found = self._manifest_of(expand(urls, "urls")[0]) if urls else None
            if found:
                return found
        return None

    def _manifest_of(self, first_url: str) -> dict | None:
        """The manifest beside the shard `first_url` (`read_manifest`), read once per data module."""
        url = manifest_url(first_url)
        if url is None:
            return None
        if url not in self.manifests:
            self.manifests[url] = read_manifest(first_url, self.read_policy)
        return self.manifests[url]

    def samples_in(self, split: str) -> int | None:
        """The samples in the shards of `split` (before any class filter), as their manifest counts them
        shard by shard; None when a shard is not in it or there is none."""
        if split not in self._urls:
            self.setup({"val": "validate", "test": "test"}.get(split, "fit"))
        urls = self._urls[split]
        counts = {
            entry["url"].rsplit("/", 1)[-1]: entry["num_samples"]
            for entry in (self._manifest_of(urls[0]) or {}).get("shards", [])
        }
        names = [url.rsplit("/", 1)[-1] for url in urls]
        return sum(counts[name] for name in names) if all(name in counts for name in names) else None

    def _check_labels(self) -> None:
        """Labels the manifest counts beyond `num_classes` would fail the first training step (an index
        error in the loss): refused here, before anything runs. A sample whose label is beyond
        the class count anyway is a corrupt sample: the stream skips and counts it."""
        counts = (self.manifest or {}).get("class_counts") or {} if self._num_classes is not None else {}
        beyond = sorted(int(label) for label in counts if int(label) >= self._num_classes)
        if beyond:
            raise UserError(
                f"the shards' manifest counts labels up to {beyond[-1]}, beyond num_classes "
                f"{self._num_classes}: set data.init_args.num_classes to at least {beyond[-1] + 1} (the "
                "manifest's num_classes), or leave it unset"
            )

    @property
    def num_classes(self) -> int | None:
        if self._num_classes is not None:
            return self._num_classes
        return self.manifest["num_classes"] if self.manifest else None

    # --- Lightning hooks ----------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        self.rank, self.world_size = self._rank_and_world_size()
        self._urls.update(
            check_shard_urls(
                stage, {f"{split}_urls": getattr(self, f"{split}_urls") for split in SPLITS}, self.read_policy
            )
        )
        for split in STAGE_SPLITS.get(stage, []):
            if split in self._urls and split != "train" and len(self._urls[split]) < self.world_size:
                raise UserError(
                    f"{split}_urls has {len(self._urls[split])} shards for {self.world_size} ranks: an exact "
                    "pass needs at least one shard per rank; re-convert with a smaller --shard-size"
                )
        if "train" in self._urls:
            self.batches_per_epoch = self.train_batches or self._batches_from_manifest()

    def _rank_and_world_size(self) -> tuple[int, int]:
        """Read in the main process and handed to the workers: a worker cannot be trusted to discover them."""
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _batches_from_manifest(self) -> int:
        samples = len(self.train_keys) if self.train_keys is not None else self._samples_from_manifest()
        batches = samples // (self.batch_size * self.world_size)
        if batches == 0:
            raise UserError(
                f"the training set has {samples} samples (after the class filter), fewer than one "
                f"batch per rank ({self.batch_size} x {self.world_size}): lower batch_size or set "
                "train_batches"
            )
        return batches

    def _samples_from_manifest(self) -> int:
        first = self._urls["train"][0]
        manifest = self._manifest_of(first)
        if manifest is None:
            url = manifest_url(first)
            where = (
                f"{url} does not exist"
                if url
                else f"only shards named SPLIT-NNNNNN.tar, not {first}, have one beside them: SPLIT.json"
            )
            raise UserError(
                f"train_urls have no manifest ({where}) to size an epoch: set data.init_args.train_batches"
            )
        if self.classes is None:
            return manifest["num_samples"]
        counts = manifest.get("class_counts", {})
        return sum(counts.get(str(c), 0) for c in self.classes)

    def train_dataloader(self) -> DataLoader:
        if "train" not in self._urls:
            self.setup("fit")
        stream = self._stream("train", self.train_preset, batches_per_epoch=self.batches_per_epoch)
        self._train_loader = EpochLoader(
            stream,
            self._start_epoch,
            timeout=self.loader_timeout_s,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )
        return self._train_loader

    def val_dataloader(self) -> DataLoader | list:
        return self.exact_dataloader("val") if self.val_urls is not None else []

    def test_dataloader(self) -> DataLoader:
        return self.exact_dataloader("test")

    def exact_dataloader(self, split: str) -> DataLoader:
        """Exact pass over a split with the eval transform: every sample once across ranks (validation,
        test, feature extraction)."""
        if split not in self._urls:
            self.setup({"val": "validate", "test": "test"}.get(split, "fit"))
        stream = self._stream(split, "eval", batches_per_epoch=None)
        return ShardLoader(
            stream,
            split=split,
            timeout=self.loader_timeout_s,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

    def eval_view(self, split: str) -> EvalView:
        """How the `eval` transform frames the images of `split`, chosen from the data: `whole` when its
        manifest records every image at `image_size` x `image_size` (CIFAR-style sets stored at the model's
        resolution: nothing to resize, and a centre crop would only throw the border away); otherwise
        `crop`, ImageNet's resize to `image_size / eval_crop_pct` and centre crop. Chosen once per split
        (from the manifest as read once, `manifests`): every pass over the split frames it this way, and
        what a run records is what it used."""
        if split not in self._views:
            if split not in self._urls:
                self.setup({"val": "validate", "test": "test"}.get(split, "fit"))
            stored = (self._manifest_of(self._urls[split][0]) or {}).get("image_size")
            self._views[split] = "whole" if stored == [self.image_size, self.image_size] else "crop"
        return self._views[split]

    def _stream(self, split: str, preset: Preset, batches_per_epoch: int | None) -> ShardStream:
        transform = (
            device_transform(self.image_size, self.crop_scale, self.draft)
            if (self.decode == "device" and preset != "eval")
            else build_transform(
                preset,
                self.image_size,
                mean=self.mean,
                crop_scale=self.crop_scale,
                # a crop fraction of 1 keeps the whole image: the resize and the crop are both identities
                crop_pct=1.0 if preset == "eval" and self.eval_view(split) == "whole" else self.eval_crop_pct,
                randaugment=self.randaugment if preset == "supervised" else None,
                draft=self.draft,
            )
        )
        return ShardStream(
            self._urls[split],
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            transform=transform,
            classes=self.classes,
            keys=self.train_keys if split == "train" else None,
            seed=self.seed,
            batches_per_epoch=batches_per_epoch,
            shuffle_buffer=self.shuffle_buffer,
            segment_shards=self.segment_shards,
            num_classes=self.num_classes,
            read_policy=self.read_policy,
        )

    def _start_epoch(self) -> tuple[int, ResumePlan | None]:
        """The epoch of the training pass about to start and, once after a resume, where each worker
        stands in it. Without a resume: the trainer's epoch when attached, else a count of passes.

        Lightning starts the first training iterator before it restores its loops (to count the steps
        for the schedule), so after a resume the epoch comes from the restored position, not from the
        trainer."""
        saved, self._resume = self._resume, None
        if saved is not None:
            epoch, plan = self._plan(saved)
        else:
            epoch, plan = (self.trainer.current_epoch if self.trainer is not None else self.epoch), None
        self.epoch = epoch + 1
        return epoch, plan

    def _plan(self, saved: dict) -> tuple[int, ResumePlan | None]:
        ranks, workers_now = saved["ranks"], max(1, self.num_workers)
        mine = ranks[self.rank] if len(ranks) == self.world_size else ranks[0]
        epoch = mine["epoch"]
        workers = {int(w): WorkerPosition(*p) for w, p in mine["workers"].items()}
        consumed = sum(p.batches for p in workers.values())
        if consumed >= self.batches_per_epoch:
            return epoch + 1, None  # saved at the end of the epoch: the next one starts afresh
        if len(ranks) != self.world_size or mine["num_workers"] != workers_now:
            log.warning(
                "exact resume needs the run's number of ranks and DataLoader workers (saved %d x %d, now "
                "%d x %d): the rest of epoch %d reads new segments of the shards, so some samples of this "
                "epoch may repeat",
                len(ranks), mine["num_workers"], self.world_size, workers_now, epoch,
            )  # fmt: skip
            after = 1 + max((p.segment for p in workers.values()), default=0)
            return epoch, ResumePlan({w: WorkerPosition(0, after, 0) for w in range(workers_now)})
        return epoch, ResumePlan(workers, first=consumed % workers_now)

    def prepare_batch(self, batch: dict) -> dict:
        """A batch as the DataLoaders give it (`image` uint8 [B,3,H,W]) -> as the model takes it
        (`image` float32 [B,3,H,W], normalised with `mean`/`std`), on the batch's device.

        Lightning calls it after moving each batch to the device (`on_after_batch_transfer`); callers
        of the DataLoaders outside Lightning (feature extraction) call it themselves, after `.to(device)`.
        Workers keep images uint8 so that they skip a float conversion per sample and move 4x fewer
        bytes; the conversion runs once per batch where the batch already is. With `decode="device"`,
        the batch's JPEGs are decoded and cropped here first (`device_decode.place_jpegs`)."""
        batch = place_jpegs(batch, self.image_size)
        return {**batch, "image": normalize(batch["image"], self.mean, self.std)}

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        """`prepare_batch`, then mixup/cutmix/label smoothing (timm) on whole training batches, on the
        device."""
        batch = self.prepare_batch(batch)
        training = self.trainer is not None and self.trainer.training
        if training and "stream" in batch and self._train_loader is not None:
            self._train_loader.record(batch)
        if not any(self.mixup_args.values()) or not training:
            return batch
        if not self.num_classes:
            raise UserError("mixup/cutmix/label_smoothing need num_classes: set data.init_args.num_classes")
        if not (self.mixup_args["mixup_alpha"] or self.mixup_args["cutmix_alpha"]):
            # label smoothing alone: timm's Mixup asserts that one of its alphas is set
            smoothing = self.mixup_args["label_smoothing"]
            batch["target"] = mixup_target(batch["label"], self.num_classes, smoothing=smoothing)
            return batch
        if self._mixup is None:
            self._mixup = Mixup(**self.mixup_args, num_classes=self.num_classes)
        batch["image"], batch["target"] = self._mixup(batch["image"], batch["label"])
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The training stream's position: the seed, the next epoch, and where every rank's workers
        stand in the current one (gathered: only rank 0 writes the checkpoint, every rank resumes from
        it; Lightning builds the checkpoint on every rank, so the collective is matched)."""
        state = {"seed": self.seed, "epoch": self.epoch}
        if "train" in self._urls:
            state["data"] = identity(self._urls["train"], self._manifest_of(self._urls["train"][0]))
        if self._train_loader is not None and self._train_loader.epoch is not None:
            local = self._train_loader.position()
            ranks = [local]
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                ranks = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(ranks, local)
            state["position"] = {"ranks": ranks}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restored by Lightning before it starts the first training iterator, except under strategies
        that restore after their own setup (FSDP2's ModelParallelStrategy): there the task's
        `configure_optimizers` (Lightning's `estimated_stepping_batches`) has started the epoch's
        iterator already, and it is started again here, from the restored position."""
        self.seed, self.epoch = state_dict["seed"], state_dict["epoch"]
        self._resume = state_dict.get("position")
        if "data" in state_dict and "train" in self._urls:  # checkpoints from before it was recorded: none
            self._check_same_data(state_dict["data"], self._urls["train"])
        started = self._train_loader is not None and self._train_loader.epoch is not None
        if started and self.trainer is not None and not self._train_loader.consumed:
            # Lightning has no public way to restart its training fetcher (which prefetches a batch).
            iter(self.trainer.fit_loop._data_fetcher)

    def refuse_changed_data(self, state_dict: dict[str, Any]) -> None:
        """With `on_data_change: refuse`, the error for training data that differ from those of the
        checkpoint whose data-module state is `state_dict`, before the fit writes anything (the CLI
        calls it first; Lightning's restore, `load_state_dict`, is after config.yaml and the W&B run)."""
        if self.on_data_change == "refuse" and "data" in state_dict and self.train_urls is not None:
            self._check_same_data(state_dict["data"], expand(self.train_urls, "train_urls"))

    def _check_same_data(self, saved: dict, urls: list[str]) -> None:
        """One line when the training data over `urls` differ from the checkpoint's: a warning, or with
        `on_data_change: refuse` the error that stops the resume."""
        found = changes(saved, identity(urls, self._manifest_of(urls[0])))
        if not found:
            return
        text = (
            f"the training data differ from the checkpoint's ({'; '.join(found)}), so this resume is not "
            "exact: the epoch's remaining samples are drawn from the data as they are now"
        )
        if self.on_data_change == "refuse":
            raise UserError(
                f"{text}: give the shards the run was trained on, or resume anyway with "
                "--data.init_args.on_data_change warn"
            )
        if self.rank == 0:
            log.warning("%s (--data.init_args.on_data_change refuse stops instead)", text)


class LogSkippedSamples(pl.Callback):
    """Logs `data/skipped_{train,val,test}`: bad samples dropped by the data pipeline, summed over
    batches and ranks (the pipeline also logs each one as a warning with its key and shard); and at the
    end of each epoch (of training, or a validation or test pass) one line naming the shards that could
    not be opened in it (deleted, or unreachable after their retries), with `data/unreadable_shards_*`:
    a pass that quietly read 3 of its 4 shards would otherwise look like any other."""

    def __init__(self) -> None:
        self.unreadable: dict[str, set[str]] = {"train": set(), "val": set(), "test": set()}

    def _log(self, pl_module: pl.LightningModule, batch: Any, stage: str) -> None:
        if not isinstance(batch, dict):
            return
        for count in ("skipped", "decoded_on_cpu"):  # per batch, summed over the epoch and the ranks
            if count in batch:
                pl_module.log(
                    f"data/{count}_{stage}", batch[count].float(), reduce_fx="sum", on_step=False,
                    on_epoch=True, sync_dist=True, batch_size=1,
                )  # fmt: skip
        self.unreadable[stage].update(batch.get("unreadable") or ())

    def _report(self, trainer, pl_module: pl.LightningModule, stage: str) -> None:
        found, self.unreadable[stage] = sorted(self.unreadable[stage]), set()
        if trainer.sanity_checking:
            return
        pl_module.log(f"data/unreadable_shards_{stage}", float(len(found)), reduce_fx="sum", sync_dist=True)
        if found:
            where = f" on rank {trainer.global_rank}" if trainer.world_size > 1 else ""
            what = {"train": f"training epoch {trainer.current_epoch}", "val": "validation", "test": "test"}
            shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            log.warning(
                "%d shard(s) could not be read in the %s%s and were skipped: %s",
                len(found), what[stage], where, shown,
            )  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._log(pl_module, batch, "train")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._log(pl_module, batch, "val")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._log(pl_module, batch, "test")

    def on_train_epoch_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "train")

    def on_validation_epoch_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "test")
