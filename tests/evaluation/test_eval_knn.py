"""Weighted k-NN (DINO): clusters, the exp(sim / T) vote, chunking."""

import math

import pytest
import torch

from ssl_vit.evaluation.knn import knn_correct


def knn_accuracy(*tensors, **options) -> float:
    """Top-1 accuracy in [0, 1] of the weighted k-NN vote; arguments and options: as `knn_correct`."""
    return knn_correct(*tensors, **options).double().mean().item()


def test_tight_clusters_are_perfect():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(6, 32, generator=g)
    train_y, test_y = torch.arange(6).repeat(10), torch.arange(6).repeat_interleave(7)
    train_x = centres[train_y] + 0.01 * torch.randn(60, 32, generator=g)
    test_x = 5 * centres[test_y] + 0.01 * torch.randn(42, 32, generator=g)  # scale: cosine ignores norms
    assert knn_accuracy(train_x, train_y, test_x, test_y, k=20) == 1.0


def unit(angle: float) -> list[float]:
    return [math.cos(angle), math.sin(angle)]


def test_weighted_vote_beats_majority():
    """k = 3 neighbours of the query [1, 0]: one of class 1 at cosine 1.0, two of class 0 at cosine
    cos(0.5). DINO's weights exp(sim / T) decide: class 1 wins at T = 0.07 (exp(1/.07) > 2 exp(.878/.07)),
    while at a high temperature the weights are nearly equal and the majority, class 0, wins."""
    train_x = torch.tensor([unit(0.0), unit(0.5), unit(-0.5), unit(3.0)])
    train_y = torch.tensor([1, 0, 0, 1])
    query, sim = torch.tensor([unit(0.0)]), math.cos(0.5)
    assert math.exp(1 / 0.07) > 2 * math.exp(sim / 0.07) and math.exp(1 / 100) < 2 * math.exp(sim / 100)
    assert knn_accuracy(train_x, train_y, query, torch.tensor([1]), k=3, temperature=0.07) == 1.0
    assert knn_accuracy(train_x, train_y, query, torch.tensor([0]), k=3, temperature=100.0) == 1.0


def test_weighted_vote_breaks_a_tie_towards_the_nearer_class():
    """k = 2: one neighbour per class, an unweighted tie; the nearer one (cosine 0.9 vs 0.8) wins whichever
    class index it has, unlike an argmax over equal counts, which would pick the lower index."""
    train_x = torch.tensor([unit(math.acos(0.8)), unit(-math.acos(0.9)), unit(3.0)])
    query = torch.tensor([unit(0.0)])
    assert knn_accuracy(train_x, torch.tensor([0, 1, 0]), query, torch.tensor([1]), k=2) == 1.0
    assert knn_accuracy(train_x, torch.tensor([1, 0, 1]), query, torch.tensor([0]), k=2) == 1.0


def test_chunks_and_k_larger_than_train_set():
    g = torch.Generator().manual_seed(1)
    train_x, test_x = torch.randn(50, 8, generator=g), torch.randn(37, 8, generator=g)
    train_y, test_y = torch.randint(0, 4, (50,), generator=g), torch.randint(0, 4, (37,), generator=g)
    whole = knn_accuracy(train_x, train_y, test_x, test_y, k=5, num_classes=4)
    assert knn_accuracy(train_x, train_y, test_x, test_y, k=5, num_classes=4, chunk_size=8) == whole
    # k beyond the training set: every training sample votes, as with k = n
    all_vote = knn_accuracy(train_x, train_y, test_x, test_y, k=50)
    assert knn_accuracy(train_x, train_y, test_x, test_y, k=500) == all_vote


def test_invalid_arguments():
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match="temperature"):
        knn_accuracy(x, y, x, y, temperature=0.0)
