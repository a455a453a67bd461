"""Weighted k-NN classification on frozen features, as in DINO (Caron et al. 2021, sec 4.1 and
`knn_classifier` in facebookresearch/dino `eval_knn.py`).

Features are L2-normalised, so the dot product is the cosine similarity; each test sample takes its k
most similar training samples, and each neighbour votes for its class with weight exp(sim / T)
(DINO: k = 20, T = 0.07). The prediction is the class with the largest summed weight.

Legend: n training samples, m test samples, c test chunk, F feature width, K classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def knn_correct(
    train_x: Tensor,
    train_y: Tensor,
    test_x: Tensor,
    test_y: Tensor,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int | None = None,
    chunk_size: int = 1024,
) -> Tensor:
    """Which test samples the weighted k-NN vote classifies correctly: (m,) bool, on CPU.

    train_x: (n, F), train_y: (n,) int64 in [0, K); test_x: (m, F), test_y: (m,) int64. All on one
    device, where the similarities are computed. num_classes: K, by default max(train_y) + 1.
    chunk_size: test samples per similarity matrix, which is (chunk_size, n): memory stays bounded
    however large the test set is (DINO splits its test set into chunks the same way).
    """
    if k < 1 or temperature <= 0:
        raise ValueError(f"k must be >= 1 and temperature > 0, got k={k}, temperature={temperature}")
    num_classes = num_classes or int(train_y.max()) + 1
    k = min(k, len(train_y))
    train_x, test_x = F.normalize(train_x.float(), dim=1), F.normalize(test_x.float(), dim=1)
    correct = []
    for start in range(0, len(test_y), chunk_size):
        similarity = test_x[start : start + chunk_size] @ train_x.T  # (c, n)
        top_sim, top_idx = similarity.topk(k, dim=1)  # (c, k)
        # DINO scatters one-hot rows and sums weighted rows; scatter_add_ sums the weights per class
        # directly, without the (c, k, K) one-hot tensor.
        votes = torch.zeros(len(top_idx), num_classes, device=top_sim.device)
        votes.scatter_add_(1, train_y[top_idx], (top_sim / temperature).exp())  # (c, K)
        correct.append((votes.argmax(1) == test_y[start : start + chunk_size]).cpu())
    return torch.cat(correct)
