"""The protocols a suite runs, one function per kind: (protocol, features, ...) -> (scores, details,
correct), `correct` mapping each score's column to which test images were classified correctly,
(S, M) bool for S few-shot seeds (S = 1 for the other kinds) and M test images in key order, the same
images for every checkpoint: what `stats` resamples for intervals and paired differences; `details`
maps the protocol's name (a trained protocol's: each of its columns) to what results.json records.

Frozen-feature protocols (few-shot, k-NN) share one exact pass per split, which yields every feature
kind the suite reads; trained protocols (linear probe, fine-tuning) run the Lightning tasks on the
suite's data, once per label fraction (`label_subset`).

A protocol that chooses among candidates (the linear probe's lr grid) chooses on images held out of its
labelled training images (`selection_split`), or on the data block's `val_urls`, never on the test
split: the test split is read after the choice, by the chosen candidate only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from timm.optim import Lars
from torch.optim import SGD, AdamW, Optimizer

from ssl_vit.errors import UserError
from ssl_vit.evaluation import progress
from ssl_vit.evaluation.features import Features, extract_feature_set, local_device
from ssl_vit.evaluation.fewshot import fewshot_correct
from ssl_vit.evaluation.knn import knn_correct
from ssl_vit.quiet import lightning_info_dropped
from ssl_vit.tasks.optim import SchedulerCallable, WarmupDecay

# ShardDataModule arguments a suite's `data` may set (the rest are the protocols' business).
DATA_KEYS = (
    "image_size", "batch_size", "num_workers", "mean", "std", "eval_crop_pct", "num_classes", "seed",
    "read_retries", "read_timeout_s", "loader_timeout_s",
)  # fmt: skip


class FeatureCache:
    """Frozen features of the suite's splits (train, test, and val when the data block gives
    `val_urls`): every kind the suite reads from one pass over each split (`extract_feature_set`),
    made the first time a split is asked for."""

    def __init__(self, backbone, data: dict[str, Any], kinds: tuple[str, ...]) -> None:
        from ssl_vit.data import ShardDataModule

        self.backbone = backbone
        self.kinds = tuple(kinds)
        self.datamodule = ShardDataModule(
            train_urls=data["train_urls"],
            val_urls=data.get("val_urls"),
            test_urls=data["test_urls"],
            **{k: v for k, v in data.items() if k in DATA_KEYS},
        )
        self._cache: dict[str, dict[str, Features]] = {}

    def get(self, split: str, feature: str) -> Features:
        if feature not in self.kinds:
            raise ValueError(f"feature {feature!r} is not among this cache's kinds {self.kinds}")
        if split not in self._cache:
            loader = self.datamodule.exact_dataloader(split)
            with progress.step(f"features of {split}", self.datamodule.samples_in(split)) as advance:
                self._cache[split] = extract_feature_set(
                    self.backbone, loader, self.kinds, prepare=self.datamodule.prepare_batch, on_batch=advance
                )
        return self._cache[split][feature]

    def splits(self) -> tuple[str, ...]:
        """The splits its data block gives."""
        return ("train", "test") if self.datamodule.val_urls is None else ("train", "val", "test")

    def labels(self, split: str) -> torch.Tensor:
        """Labels of a split: they do not depend on the feature, so the split's one pass serves."""
        return self.get(split, self.kinds[0]).y

    def num_classes(self) -> int:
        return self.datamodule.num_classes or int(self.labels("train").max()) + 1

    def eval_views(self) -> dict[str, str]:
        """How the eval transform framed each split: the data module chooses once per split, from the
        manifest as it read it once, so this is the view every pass over the split used."""
        return {split: self.datamodule.eval_view(split) for split in self.splits()}


def _restrict(features: Features, classes: list[int] | None) -> Features:
    if classes is None:
        return features
    keep = _class_mask(features.y, classes)
    return Features(
        features.x[keep], features.y[keep], [k for k, m in zip(features.keys, keep.tolist()) if m]
    )


def fewshot(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    train, test = features.get("train", protocol.feature), features.get("test", protocol.feature)
    correct = fewshot_correct(
        train.x,
        train.y,
        test.x,
        test.y,
        shots=tuple(protocol.shots),
        seeds=tuple(protocol.seeds),
        ridge=protocol.ridge,
        classes=protocol.classes,
    )
    correct = {f"{protocol.name}_{shots}shot": hits for shots, hits in correct.items()}
    detail = {"test_samples": next(iter(correct.values())).shape[1]}
    return _scores(correct), {protocol.name: detail}, correct


def knn(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    train = _restrict(features.get("train", protocol.feature), protocol.classes)
    test = _restrict(features.get("test", protocol.feature), protocol.classes)
    hits = knn_correct(train.x, train.y, test.x, test.y, k=protocol.k, temperature=protocol.temperature)
    correct = {protocol.name: hits[None]}
    detail = {"train_samples": len(train.y), "test_samples": len(test.y)}
    return _scores(correct), {protocol.name: detail}, correct


def _scores(correct: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each column's accuracy: the mean over seeds and images of its (S, M) correctness."""
    return {column: hits.double().mean().item() for column, hits in correct.items()}


def label_subset(
    labels: torch.Tensor, fraction: float, seed: int, classes: list[int] | None = None
) -> torch.Tensor:
    """The labelled training samples a label fraction keeps: (n,) sorted indices into `labels` (N,).

    Class-balanced: each class (of `classes`, else every label present; -1 is unlabelled) keeps
    max(1, round(fraction x its count)) of its samples, drawn without replacement from `seed` (the
    suite's, so every checkpoint trains on the same images and paired differences stay paired). Each
    class's draw is one permutation whatever the fraction, so one seed's subsets are nested: the 1% lies
    inside the 10%.
    """
    generator = torch.Generator().manual_seed(seed)
    wanted = torch.unique(labels[labels >= 0]) if classes is None else sorted(set(classes))
    chosen = []
    for c in [int(c) for c in wanted]:
        members = torch.nonzero(labels == c).flatten()
        keep = max(1, round(fraction * len(members)))
        chosen.append(members[torch.randperm(len(members), generator=generator)[:keep]])
    return torch.cat(chosen).sort().values


def linear_probe(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    from ssl_vit.tasks import LinearProbe

    def build() -> LinearProbe:
        return LinearProbe(
            backbone=config,
            init_from=source,
            num_classes=features.num_classes(),
            feature=protocol.feature,
            lrs=list(protocol.lrs),
            batch_norm=protocol.batch_norm,
            # each head's lr is its own param group's (LinearProbe.param_groups)
            optimizer=optimizer(protocol, protocol.lrs[0]),
            lr_scheduler=schedule(protocol),
        )

    def score(model: LinearProbe, selection: Features | None) -> tuple[torch.Tensor, dict]:
        # The head is chosen on the selection images; only then are the test features read, and
        # only the chosen head scores them. The probe's frozen backbone is the one the cached features
        # came from (see _train), so neither needs a pass of its own.
        head, chosen = (0, {}) if selection is None else select_head(model, selection)
        test = _restrict(features.get("test", protocol.feature), protocol.classes)
        return _head_logits(model, test.x)[head].argmax(1) == test.y, {"best_lr": model.lrs[head], **chosen}

    train = _train_heads if protocol.augmentation == "eval" else _train
    return _per_label_fraction(protocol, features, suite, build, score, train)


def select_head(model, selection: Features) -> tuple[int, dict]:
    """The head of `model` (a trained `LinearProbe`) with the best accuracy on the `selection` features
    (of equals, the first in the grid's order), and each head's accuracy there."""
    hits = _head_logits(model, selection.x).argmax(2) == selection.y  # (heads, n)
    accuracy = hits.double().mean(1)
    head = int(accuracy.argmax())
    chosen = {"selection_accuracy": {f"{lr:g}": a for lr, a in zip(model.lrs, accuracy.tolist())}}
    edge = grid_edge(model.lrs, accuracy.tolist(), head)
    return head, {**chosen, **({"lr_at_grid_edge": edge} if edge else {})}


def grid_edge(lrs: list[float], accuracy: list[float], head: int) -> str | None:
    """The grid's end, "largest" or "smallest", when the chosen lr `lrs[head]` ends a grid of several
    and beats its neighbour in the grid on the held-out images (`accuracy`, one per lr): the best lr may
    lie beyond the grid (`grid_edge_notes`)."""
    order = sorted(range(len(lrs)), key=lambda i: lrs[i])
    if len(lrs) < 2 or head not in (order[0], order[-1]):
        return None
    neighbour = order[1] if head == order[0] else order[-2]
    if accuracy[head] <= accuracy[neighbour]:
        return None
    return "largest" if head == order[-1] else "smallest"


def grid_edge_notes(records: list[dict]) -> list[str]:
    """One line per trained column whose chosen lr ended its grid in any of `records` (results.json
    records of one suite): how often, and what to do."""
    edges: dict[tuple[str, str], list[float]] = {}
    runs: dict[str, int] = {}
    for record in records:
        for column, found in record.get("details", {}).items():
            if isinstance(found, dict) and "best_lr" in found and "selection_accuracy" in found:
                runs[column] = runs.get(column, 0) + 1
                if found.get("lr_at_grid_edge"):
                    edges.setdefault((column, found["lr_at_grid_edge"]), []).append(found["best_lr"])
    direction = {"largest": "above", "smallest": "below"}
    return [
        f"{column}: the lr chosen on the held-out images is the grid's {edge} ({lrs[0]:g}) in {len(lrs)} "
        f"of {runs[column]} run(s); a better one may lie {direction[edge]} it: extend the protocol's lrs"
        for (column, edge), lrs in edges.items()
    ]


def _head_logits(model, x: torch.Tensor) -> torch.Tensor:
    """(N, D) frozen features -> every head's logits (H, N, K), on the CPU, in eval mode."""
    model.eval()
    with torch.no_grad():
        return model.classify(x.to(model.device)).cpu()


def finetune(protocol, features: FeatureCache, source, config, suite) -> tuple[dict, dict, dict]:
    from ssl_vit.tasks import FineTune

    def build() -> FineTune:
        return FineTune(
            backbone=config,
            init_from=source,
            num_classes=features.num_classes(),
            feature=protocol.feature,
            layer_decay=protocol.layer_decay,
            optimizer=optimizer(protocol, protocol.lr),
            lr_scheduler=schedule(protocol),
        )

    def score(model: FineTune, selection: Features | None) -> tuple[torch.Tensor, dict]:
        return _correct(model, features, protocol.classes), {}

    return _per_label_fraction(protocol, features, suite, build, score)


def _per_label_fraction(
    protocol, features: FeatureCache, suite, build, score, train=None
) -> tuple[dict, dict, dict]:
    """A trained protocol's columns: for each label fraction, a fresh task from `build()` trained on
    that fraction's training images, then `score(task, selection)` -> ((M,) bool correct test images,
    details), `selection` being the features of the images held out to choose among the protocol's
    candidates (None when it has one). `train(task, protocol, suite, features, keys)`: `_train` unless
    given."""
    details, correct = {}, {}
    for fraction in protocol.label_fractions:
        column = protocol.column(fraction)
        keys, selection, used = _training_set(protocol, features, fraction, suite.seed)
        model = build()
        metrics = (train or _train)(model, protocol, suite, features, keys)
        hits, extra = score(model, selection)
        correct[column] = hits[None]
        details[column] = {**used, **extra, **metrics}
    return _scores(correct), details, correct


def optimizer(protocol, lr: float) -> Callable[[list[dict]], Optimizer]:
    """The protocol's optimizer over a task's param groups (a group's own lr wins over `lr`)."""
    if protocol.optimizer == "adamw":
        return partial(AdamW, lr=lr, betas=tuple(protocol.betas), weight_decay=protocol.weight_decay)
    if protocol.optimizer == "sgd":
        return partial(SGD, lr=lr, momentum=protocol.momentum, weight_decay=protocol.weight_decay)
    # LARS (You et al. 2017; MAE's linear probe, appendix A.2) is timm's. `always_adapt`: MAE's scales
    # every weight's step by its trust ratio, while timm's would scale only groups with weight decay,
    # and a probe has none.
    return partial(
        Lars, lr=lr, momentum=protocol.momentum, weight_decay=protocol.weight_decay, always_adapt=True
    )


def schedule(protocol) -> SchedulerCallable:
    """The protocol's lr schedule: linear warmup, then cosine or linear decay (`WarmupDecay`)."""
    return partial(
        WarmupDecay,
        warmup_steps=protocol.warmup_steps,
        decay=protocol.decay,
        min_lr_ratio=protocol.min_lr_ratio,
    )


def selection_split(labels: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labelled images (N,) -> (train, select): sorted positions into `labels` to train on and to hold out
    for choosing among a protocol's candidates.

    Class-balanced: each class of c images holds out min(c - 1, max(1, round(fraction x c))) of them, so
    every class keeps at least one image to train on (a class of one image holds none out). Drawn from
    `seed` (the suite's: every checkpoint is selected on the same images), one permutation per class.
    """
    generator = torch.Generator().manual_seed(seed)
    held = []
    for c in torch.unique(labels).tolist():
        members = torch.nonzero(labels == c).flatten()
        keep = min(len(members) - 1, max(1, round(fraction * len(members))))
        held.append(members[torch.randperm(len(members), generator=generator)[:keep]])
    select = torch.cat(held).sort().values
    train = torch.ones(len(labels), dtype=torch.bool)
    train[select] = False
    return torch.nonzero(train).flatten(), select


def _training_set(
    protocol, features: FeatureCache, fraction: float, seed: int
) -> tuple[list[str] | None, Features | None, dict]:
    """What one label fraction of a trained protocol trains on: the keys of its training images (None
    for all: the datamodule's own class filter then reads the whole split), the features of the images
    it chooses its candidate on (None with one candidate) and what results.json records of them.

    The selection images come out of the fraction's labelled images (`selection_split`), so a 1% column
    never sees more than 1% of the labels, unless the data block gives `val_urls`: then the whole val
    split (of `classes`) is the selection set. `labels` counts every labelled image used, selection
    images included; `labels_per_class` is that over the classes (the x of its point in the pictures)."""
    train = features.get("train", protocol.feature)
    chosen = label_subset(train.y, fraction, seed, protocol.classes)
    selection, used = None, {}
    if protocol.candidates() > 1 and features.datamodule.val_urls is not None:
        selection = _restrict(features.get("val", protocol.feature), protocol.classes)
        used = {"selected_on": "val_urls"}
    elif protocol.candidates() > 1:
        kept, held = selection_split(train.y[chosen], protocol.select_fraction, seed)
        held, chosen = chosen[held], chosen[kept]
        if len(held) == 0:
            raise UserError(
                f"protocol {protocol.name!r}: {fraction:g} of the labels leaves one image per class, none "
                f"to choose among its {protocol.candidates()} candidates on: give one lr, a larger "
                "label fraction, or val_urls in the data block"
            )
        selection = Features(train.x[held], train.y[held], [train.keys[i] for i in held.tolist()])
        used = {"selected_on": "train_urls (held out)"}
    if selection is not None:
        used["selection_images"] = len(selection.y)
    labels = len(chosen) + (len(selection.y) if selection is not None else 0)
    classes = len(train.y[chosen].unique())
    used = {
        "fraction": fraction, "labels": labels, "labels_per_class": labels / max(1, classes),
        "training_images": len(chosen), **used,
    }  # fmt: skip
    keys = None if fraction == 1 and selection is None else [train.keys[i] for i in chosen.tolist()]
    return keys, selection, used


def _advancing(advance: Callable[[int], None]):
    """A Lightning callback calling `advance(1)` after each training step (the progress display)."""
    import pytorch_lightning as pl

    class Advance(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            advance(1)

    return Advance()


def _correct(model, features: FeatureCache, classes: list[int] | None) -> torch.Tensor:
    """(M,) bool: which test images (of `classes`, in key order, as the cached features) the trained
    `model` (images (B, 3, H, W) -> logits (B, K)) classifies correctly; one pass over the test split."""
    model.eval()
    hits, labels, keys = [], [], []
    total = features.datamodule.samples_in("test")
    with torch.inference_mode(), progress.step("scoring the test split", total) as advance:
        for batch in features.datamodule.exact_dataloader("test"):
            batch = features.datamodule.prepare_batch({**batch, "image": batch["image"].to(model.device)})
            hits.append((model(batch["image"]).argmax(1) == batch["label"]).cpu())
            labels.append(batch["label"].cpu())
            keys.extend(batch["key"])
            advance(len(batch["key"]))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    hits, labels = torch.cat(hits)[order], torch.cat(labels)[order]
    return hits if classes is None else hits[torch.isin(labels, torch.tensor(classes))]


def _train(model, protocol, suite, features: FeatureCache, keys: list[str] | None) -> dict[str, float]:
    """Train `model` on the suite's train split (only the samples `keys` when given) for the protocol's
    epochs or steps, through its training transform; the test split is never read here. Returns the
    optimizer steps taken and the last training loss."""
    import pytorch_lightning as pl

    from ssl_vit.data import ShardDataModule

    _start_from_scored_backbone(model, features)
    data = suite.datasets[protocol.dataset]
    # An epoch of a labelled subset is its images in whole batches, at least one (the stream resamples a
    # subset smaller than a batch); with `steps`, one epoch of all the steps: the stream reads the whole
    # split to find a subset's images, and an epoch per batch would start its workers and read again.
    batches = protocol.steps or max(1, len(keys or ()) // protocol.batch_size)
    subset = {} if keys is None else dict(train_keys=keys, train_batches=batches)
    datamodule = ShardDataModule(
        train_urls=data["train_urls"],
        classes=protocol.classes,
        **protocol.augment(),
        **subset,
        **{k: v for k, v in data.items() if k in DATA_KEYS and k != "batch_size"},
        batch_size=protocol.batch_size,
    )
    # the manifests as the frozen protocols' data module read them: the same epoch size and eval view
    datamodule.manifests = features.datamodule.manifests
    if protocol.steps is None:
        length = dict(max_epochs=protocol.epochs)
    else:
        length = dict(max_epochs=-1, max_steps=protocol.steps)
    device = local_device()  # under torchrun, this rank's own GPU
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "auto",
        devices=[device.index] if device.type == "cuda" else 1,
        **length,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    total = protocol.steps or (batches * protocol.epochs if keys is not None else None)
    with progress.step(f"{protocol.name}: training", total, unit="steps") as advance:
        trainer.callbacks.append(_advancing(advance))
        with lightning_info_dropped("`Trainer.fit` stopped"):  # the end of one protocol, not the command's
            trainer.fit(model, datamodule=datamodule)
    return {
        "optimizer_steps": trainer.global_step,
        "train_loss": float(trainer.callback_metrics["train/loss"]),
    }


def _train_heads(model, protocol, suite, features: FeatureCache, keys: list[str] | None) -> dict[str, float]:
    """`_train` for a linear probe whose training transform is `eval`: its frozen backbone would see
    exactly the images the cache holds features of, so the heads train on those features instead of a
    forward pass per step. Same optimizer, schedule, batch size and epochs (an epoch: the training images
    in whole batches, at least one batch). Hand-written: a Lightning Trainer would add a DataLoader and
    device handling around a few hundred steps on tensors already in memory."""
    _start_from_scored_backbone(model, features)
    train = features.get("train", protocol.feature)
    rows = (
        torch.nonzero(_class_mask(train.y, protocol.classes)).flatten()
        if keys is None
        else torch.tensor(_positions(train.keys, keys))
    )
    device = local_device()
    model.to(device).train()
    x, y = train.x[rows].to(device), train.y[rows].to(device)
    size = protocol.batch_size
    steps = protocol.steps or protocol.epochs * max(1, len(y) // size)
    generator = torch.Generator().manual_seed(suite.seed)
    # Consecutive shuffles of the training images, cut into batches (a set smaller than a batch repeats).
    order = torch.cat(
        [torch.randperm(len(y), generator=generator) for _ in range(-(-steps * size // len(y)))]
    )
    optim = optimizer(protocol, protocol.lrs[0])(model.param_groups())
    scheduler = schedule(protocol)(optim, steps)
    with progress.step(f"{protocol.name}: training", steps, unit="steps") as advance:
        for step in range(steps):
            batch = order[step * size : (step + 1) * size].to(device)
            loss = model.forward_loss(model.classify(x[batch]), y[batch])
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            scheduler.step()
            advance(1)
    return {"optimizer_steps": steps, "train_loss": loss.item() / len(model.heads)}


def _start_from_scored_backbone(model, features: FeatureCache) -> None:
    """Start from the very backbone the frozen protocols scored: for `scratch`, the task's own random
    draw would otherwise differ from theirs, and paired differences would compare two backbones."""
    model.backbone.load_state_dict(features.backbone.state_dict())


def _class_mask(labels: torch.Tensor, classes: list[int] | None) -> torch.Tensor:
    return (
        torch.ones_like(labels, dtype=torch.bool)
        if classes is None
        else torch.isin(labels, torch.tensor(classes))
    )


def _positions(keys: list[str], wanted: list[str]) -> list[int]:
    """The positions in `keys` of the `wanted` keys."""
    where = {key: i for i, key in enumerate(keys)}
    return [where[key] for key in wanted]
