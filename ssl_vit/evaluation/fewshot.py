"""The ViT paper's few-shot linear evaluation: closed-form regularised least squares on frozen features.

Protocol (ViT paper sec 4.1 "Metrics" and appendix; big_vision's `evaluators/fewshot_lsr.py`, the code
behind the paper's numbers): for each shot count and seed, sample `shots` training examples per class,
standardise the features with that support set's mean and std, append a constant bias feature, and
solve the L2-regularised least-squares problem that maps them to {-1, 1}^K one-hot targets; predict
the argmax on the test features (standardised with the *support* statistics) and report accuracy,
as mean and std over seeds.

Everything runs in float64 on the features' device: with lambda = 1024 and standardised features the
normal equations are well conditioned, but the 1e-6 agreement with a reference solver needs float64.

Legend: n support samples, m test samples, F feature width, K classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# big_vision's BIAS_CONSTANT: the bias is a constant feature of value 100 rather than 1, so that the
# ridge penalty on its weight is effectively lambda / 100^2, i.e. the bias is almost unregularised.
BIAS = 100.0
# big_vision adds 1e-5 to the std so that constant features (common with 1 shot) do not divide by 0.
STD_EPS = 1e-5


class RidgeModel(NamedTuple):
    weights: Tensor  # (F + 1, K) float64; the last row multiplies the bias feature
    mean: Tensor  # (F,) float64, support-set mean
    std: Tensor  # (F,) float64, support-set std (+ STD_EPS)


def _design(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """x: (n, F) -> standardised features with the constant bias column, (n, F + 1) float64."""
    x = (x.to(torch.float64) - mean) / std
    return F.pad(x, (0, 1), value=BIAS)


def ridge_fit(x: Tensor, y: Tensor, num_classes: int, ridge: float = 1024.0) -> RidgeModel:
    """Fit the few-shot regressor. x: (n, F) features, y: (n,) int64 labels in [0, num_classes).

    Minimises ||X W - Y||^2 + ridge ||W||^2 with X the standardised features plus bias column (n, F+1)
    and Y = 2 * one_hot(y) - 1 (n, K), the same problem as scikit-learn's
    `Ridge(alpha=ridge, fit_intercept=False)` on X.
    """
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]")
    x = x.to(torch.float64)
    mean = x.mean(0)
    std = x.std(0, correction=0) + STD_EPS  # population std, as jnp.std in big_vision
    design = _design(x, mean, std)  # (n, F+1)
    targets = 2.0 * F.one_hot(y, num_classes).to(design) - 1.0  # (n, K) in {-1, 1}
    n, dim = design.shape
    # Solve the smaller of two equivalent linear systems (push-through identity
    # (X^T X + l I)^-1 X^T = X^T (X X^T + l I)^-1): the primal (F+1)x(F+1) one when there are more
    # samples than features, the dual n x n one otherwise. Few-shot support sets are tiny (10 classes x
    # 5 shots = 50 rows against F = 768), so the dual is what usually runs; big_vision makes the same
    # choice with an eigendecomposition, which pays off only when sweeping many lambdas.
    if n >= dim:
        gram = design.T @ design + ridge * torch.eye(dim, dtype=design.dtype, device=design.device)
        weights = torch.linalg.solve(gram, design.T @ targets)
    else:
        gram = design @ design.T + ridge * torch.eye(n, dtype=design.dtype, device=design.device)
        weights = design.T @ torch.linalg.solve(gram, targets)
    return RidgeModel(weights, mean, std)


def ridge_predict(model: RidgeModel, x: Tensor) -> Tensor:
    """x: (m, F) features -> (m,) int64 predicted class indices (argmax of the regressed scores)."""
    return (_design(x, model.mean, model.std) @ model.weights).argmax(1)


def draw_per_class(labels: Tensor, classes: Iterable[int], seed: int, count: Callable[[int], int]) -> Tensor:
    """Positions into `labels` (n,), class by class of `classes`: `count(c)` of the class's c samples,
    drawn without replacement, one permutation per class from one generator seeded with `seed` (big_vision
    samples each class independently as well). A few-shot support set, a label fraction, the images
    held out to choose on (`ssl_vit.evaluation.trained`)."""
    generator = torch.Generator().manual_seed(seed)
    chosen = [torch.zeros(0, dtype=torch.int64)]
    for c in classes:
        members = torch.nonzero(labels == c).flatten()
        chosen.append(members[torch.randperm(len(members), generator=generator)[: count(len(members))]])
    return torch.cat(chosen)


def fewshot_correct(
    train_x: Tensor,
    train_y: Tensor,
    test_x: Tensor,
    test_y: Tensor,
    shots: Sequence[int] = (1, 5, 10, 25),
    seeds: Sequence[int] = (0, 1, 2),
    ridge: float = 1024.0,
    classes: Sequence[int] | None = None,
) -> dict[int, Tensor]:
    """Which test samples each support draw classifies correctly: {shots: (S, m') bool} for S `seeds`
    and the m' test samples of `classes`, in their order in `test_x` (what intervals resample).

    train_x: (n, F), train_y: (n,) int64: the pool the support sets are sampled from (per seed).
    test_x: (m, F), test_y: (m,) int64. All four on one device, where the solve runs.
    classes: restrict support and test sets to these labels (e.g. held-out classes 5-9); by default the
        labels present in `train_y`. Unlabelled samples (label -1) are always dropped.

    Raises ValueError when a class has fewer training samples than a requested shot count: a silently
    missing column would make reports over several checkpoints or datasets incomparable.
    """
    classes_t = torch.unique(train_y[train_y >= 0]) if classes is None else torch.tensor(sorted(set(classes)))
    classes_t = classes_t.to(train_y.device)
    if len(classes_t) < 2:
        raise ValueError(f"few-shot classification needs at least 2 classes, got {classes_t.tolist()}")
    # Keep the chosen classes and renumber them 0..K-1 for the one-hot targets.
    train_keep, test_keep = torch.isin(train_y, classes_t), torch.isin(test_y, classes_t)
    train_x, train_y = train_x[train_keep], torch.searchsorted(classes_t, train_y[train_keep])
    test_x, test_y = test_x[test_keep], torch.searchsorted(classes_t, test_y[test_keep])
    if len(test_y) == 0:
        raise ValueError(f"no test samples of classes {classes_t.tolist()}")
    num_classes = len(classes_t)
    counts = torch.bincount(train_y, minlength=num_classes)
    if counts.min() < max(shots):
        short = {int(c): int(n) for c, n in zip(classes_t, counts) if n < max(shots)}
        raise ValueError(
            f"{max(shots)}-shot needs {max(shots)} training samples per class; classes with fewer "
            f"(class: count): {short}. Lower the shots or add training samples."
        )
    results, pool = {}, train_y.cpu()  # the support sets are drawn on the CPU
    for k in shots:
        correct = []
        for seed in seeds:
            support = draw_per_class(pool, range(num_classes), seed, partial(min, k)).to(train_y.device)
            model = ridge_fit(train_x[support], train_y[support], num_classes, ridge)
            correct.append((ridge_predict(model, test_x) == test_y).cpu())
        results[k] = torch.stack(correct)
    return results


def fewshot_accuracy(
    train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, **options
) -> dict[int, tuple[float, float]]:
    """Few-shot accuracy for each shot count: {shots: (mean, std)} over `seeds`, as fractions in [0, 1];
    the std is the population std over seeds (0 for a single seed). Arguments and options: as
    `fewshot_correct`."""
    correct = fewshot_correct(train_x, train_y, test_x, test_y, **options)
    results = {}
    for k, hits in correct.items():
        acc = hits.double().mean(1)
        results[k] = (acc.mean().item(), acc.std(correction=0).item())
    return results
