"""Closed-form few-shot probe: agreement with scikit-learn's Ridge, the protocol's sampling and errors."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import Ridge

from ssl_vit.evaluation.fewshot import BIAS, STD_EPS, fewshot_accuracy, ridge_fit, ridge_predict


def blobs(n_per_class: int, num_classes: int, dim: int, spread: float, seed: int = 0):
    """Gaussian blobs around random centres: (n, dim) float32 features, (n,) int64 labels."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=g) * 3
    y = torch.arange(num_classes).repeat_interleave(n_per_class)
    return centres[y] + spread * torch.randn(len(y), dim, generator=g), y


@pytest.mark.parametrize("n_per_class, dim", [(40, 8), (3, 50)], ids=["primal", "dual"])
def test_ridge_matches_sklearn(n_per_class, dim):
    x, y = blobs(n_per_class, 4, dim, spread=3.0)
    test_x, _ = blobs(30, 4, dim, spread=3.0, seed=1)
    model = ridge_fit(x, y, num_classes=4, ridge=1024.0)
    assert model.weights.dtype == torch.float64 and model.weights.shape == (dim + 1, 4)

    # the same problem by hand for sklearn: support-set standardisation, constant bias column, {-1, 1}
    # targets, and the bias inside the design matrix (hence fit_intercept=False)
    xn = x.double().numpy()
    mean, std = xn.mean(0), xn.std(0) + STD_EPS

    def design(a):
        return np.hstack([(a.double().numpy() - mean) / std, np.full((len(a), 1), BIAS)])

    targets = 2.0 * np.eye(4)[y.numpy()] - 1.0
    reference = Ridge(alpha=1024.0, fit_intercept=False, solver="cholesky").fit(design(x), targets)
    np.testing.assert_allclose(model.weights.numpy(), reference.coef_.T, atol=1e-6)
    scores = design(test_x) @ model.weights.numpy()
    np.testing.assert_allclose(scores, reference.predict(design(test_x)), atol=1e-6)
    assert torch.equal(
        ridge_predict(model, test_x), torch.from_numpy(reference.predict(design(test_x)).argmax(1))
    )


def test_ridge_rejects_labels_outside_classes():
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        ridge_fit(torch.randn(4, 2), torch.tensor([0, 1, 2, 3]), num_classes=3)


def test_separable_features_are_perfect():
    x, y = blobs(30, 5, 16, spread=0.1)
    test_x, test_y = blobs(20, 5, 16, spread=0.1)  # same centres (seed 0), other samples
    result = fewshot_accuracy(x, y, test_x, test_y, shots=(1, 5), seeds=(0, 1))
    assert result == {1: (1.0, 0.0), 5: (1.0, 0.0)}


def test_mean_and_std_over_seeds():
    """Noisy blobs, so seeds differ: the reported pair is the mean and population std of the per-seed
    accuracies, each a support set of `shots` per class sampled from the training features."""
    x, y = blobs(25, 3, 6, spread=4.0)
    test_x, test_y = blobs(40, 3, 6, spread=4.0, seed=0)
    result = fewshot_accuracy(x, y, test_x, test_y, shots=(1, 5), seeds=(0, 1, 2))
    single = {
        k: [fewshot_accuracy(x, y, test_x, test_y, shots=(k,), seeds=(s,))[k] for s in (0, 1, 2)]
        for k in (1, 5)
    }
    for k, per_seed in single.items():
        accs = np.array([mean for mean, std in per_seed])
        assert all(std == 0.0 for _, std in per_seed)
        assert result[k] == pytest.approx((accs.mean(), accs.std()), abs=1e-12)
    assert len(set(np.round([m for m, _ in single[1]], 9))) > 1  # seeds draw different support sets
    # a seed reproduces its result
    assert fewshot_accuracy(x, y, test_x, test_y, shots=(5,), seeds=(1,)) == {5: single[5][1]}


def test_support_sets_are_shots_per_class_from_train(monkeypatch):
    """Each (shots, seed) fits on `shots` distinct training rows per class, a different draw per seed."""
    from ssl_vit.evaluation import fewshot

    fits = []

    def recording_fit(x, y, num_classes, ridge):
        fits.append((x, y))
        return ridge_fit(x, y, num_classes, ridge)

    monkeypatch.setattr(fewshot, "ridge_fit", recording_fit)
    x, y = blobs(12, 3, 5, spread=1.0)
    fewshot_accuracy(x, y, x, y, shots=(1, 5), seeds=(0, 1))
    assert [len(fy) for _, fy in fits] == [3, 3, 15, 15]
    rows = {tuple(r.tolist()): label for r, label in zip(x, y.tolist())}
    for fx, fy in fits:
        assert torch.equal(torch.bincount(fy), torch.full((3,), len(fy) // 3))
        assert len({tuple(r.tolist()) for r in fx}) == len(fx)  # without replacement
        assert all(rows[tuple(r.tolist())] == label for r, label in zip(fx, fy.tolist()))
    assert not torch.equal(fits[2][0], fits[3][0])  # seeds 0 and 1 draw different 5-shot sets


def test_classes_restriction_and_unlabelled_samples():
    x, y = blobs(20, 4, 8, spread=0.5)
    # classes 2 and 3 separable, 0 and 1 on top of each other: restricting to {2, 3} must ignore 0/1
    x[y == 1] = x[y == 0][: (y == 1).sum()]
    y_unlabelled = torch.cat([y, torch.full((5,), -1)])
    x_unlabelled = torch.cat([x, torch.randn(5, 8)])
    held_out = fewshot_accuracy(x_unlabelled, y_unlabelled, x, y, shots=(5,), seeds=(0,), classes=[3, 2])
    assert held_out == {5: (1.0, 0.0)}
    full = fewshot_accuracy(x_unlabelled, y_unlabelled, x, y, shots=(5,), seeds=(0,))
    assert full[5][0] < 0.9  # classes 0 and 1 are indistinguishable, so the unrestricted set is not perfect


def test_too_few_samples_per_class_raises():
    x, y = blobs(4, 3, 5, spread=1.0)
    with pytest.raises(ValueError, match="5-shot needs 5"):
        fewshot_accuracy(x, y, x, y, shots=(1, 5))
    with pytest.raises(ValueError, match="at least 2 classes"):
        fewshot_accuracy(x, y, x, y, shots=(1,), classes=[1])
    with pytest.raises(ValueError, match="no test samples"):
        fewshot_accuracy(x, y, x[y == 0], y[y == 0], shots=(1,), classes=[1, 2])
