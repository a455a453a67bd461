"""Attention probabilities of a timm ViT, the ViT paper's mean attention distance (sec 4.5, Figure 7
right) and attention rollout (Abnar & Zuidema 2020).

timm's `Attention` computes attention with fused scaled-dot-product attention, which never forms the
probability matrix. `AttentionRecorder` takes each block's queries and keys where timm hands them over
(the outputs of `attn.q_norm` and `attn.k_norm`, identity modules unless the model uses QK-norm) and
computes softmax(q k^T * scale) itself, alongside the unchanged forward pass: the backbone's outputs
are exactly those without the recorder. ssl-vit's blocks never pass an attention mask, so none is
applied here.

Legend: B batch, L blocks, H heads, T tokens (P prefix ([class]) tokens + N patches), N = gh x gw.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from ssl_vit.models.vit import ViT


class AttentionRecorder:
    """While active (a context manager), every forward pass of `backbone` leaves each block's attention
    probabilities in `probs`: L tensors (B, H, T, T), float32, rows summing to 1 (queries x keys).

        with AttentionRecorder(backbone) as recorder:
            backbone.forward_tokens(images)
        recorder.probs[layer]
    """

    def __init__(self, backbone: ViT) -> None:
        self.backbone = backbone
        self.probs: list[Tensor | None] = [None] * len(backbone.blocks)
        self._queries: list[Tensor | None] = [None] * len(backbone.blocks)
        self._handles: list = []

    def __enter__(self) -> AttentionRecorder:
        for layer, block in enumerate(self.backbone.blocks):
            # timm calls q_norm before k_norm in every forward, so a layer's keys find its queries.
            self._handles.append(block.attn.q_norm.register_forward_hook(partial(self._keep_queries, layer)))
            self._handles.append(block.attn.k_norm.register_forward_hook(partial(self._attend, layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._queries = [None] * len(self.backbone.blocks)

    def _keep_queries(self, layer: int, module, args, queries: Tensor) -> None:
        self._queries[layer] = queries  # (B, H, T, head_dim)

    def _attend(self, layer: int, module, args, keys: Tensor) -> None:
        queries, self._queries[layer] = self._queries[layer], None
        scale = self.backbone.blocks[layer].attn.scale
        logits = (queries.float() * scale) @ keys.float().transpose(-2, -1)  # (B, H, T, T)
        self.probs[layer] = logits.softmax(dim=-1)


def patch_distances(grid: tuple[int, int], pixels_per_token: int) -> Tensor:
    """(N, N) Euclidean distances in pixels between patch centres: grid distance x patch size."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    centres = torch.stack([rows, cols], dim=-1).reshape(-1, 2).double() * pixels_per_token
    return torch.cdist(centres, centres)


def mean_attention_distance(probs: Tensor, distances: Tensor, prefix_tokens: int) -> Tensor:
    """The ViT paper's attention distance of each head (sec 4.5, Figure 7 right), per image.

    probs: (B, H, T, T) attention probabilities; distances: (N, N) from `patch_distances`.
    Returns (B, H): for each head, the attention-weighted distance from a query patch to the key
    patches, averaged over the query patches.

    The [class] token has no place in the image, so it is left out on both sides: it is not a query,
    and the attention a patch pays to it is dropped and the rest renormalised over the N patches. The
    distance then says how far a head looks *within the image*, whatever share of its attention goes
    to the [class] token (not renormalising would count that share as distance 0, making a head that
    attends mostly to [class] look local).
    """
    patches = probs[..., prefix_tokens:, prefix_tokens:].double()  # (B, H, N, N)
    patches = patches / patches.sum(-1, keepdim=True)
    return (patches * distances.to(patches.device)).sum(-1).mean(-1).float()


@torch.no_grad()
def attention_distance(backbone: ViT, images: Tensor, batch_size: int) -> Tensor:
    """images: (n, 3, H, W) normalised model inputs -> (L, H) mean attention distance in pixels of
    every head of every block, averaged over the n images and their query patches. The backbone should
    be in eval mode (no dropout or drop path)."""
    device = next(backbone.parameters()).device
    distances = patch_distances(backbone.grid_size, backbone.pixels_per_token)
    total = torch.zeros(len(backbone.blocks), backbone.blocks[0].attn.num_heads, dtype=torch.float64)
    with AttentionRecorder(backbone) as recorder:
        for batch in images.split(batch_size):
            backbone.forward_tokens(batch.to(device))
            for layer, probs in enumerate(recorder.probs):
                per_image = mean_attention_distance(probs, distances, backbone.num_prefix_tokens)
                total[layer] += per_image.sum(0).double().cpu()
    return (total / len(images)).float()


def attention_rollout(probs: list[Tensor]) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020, sec 3): how much each output token draws on each input
    token through all layers. Per layer, heads are averaged, the identity is added for the residual
    connection and rows are renormalised; layers are multiplied from the first up.

    probs: L tensors (B, H, T, T). Returns (B, T, T), rows summing to 1.
    """
    tokens = probs[0].shape[-1]
    eye = torch.eye(tokens, dtype=torch.float64, device=probs[0].device)
    rollout = eye.expand(probs[0].shape[0], -1, -1)
    for layer in probs:
        mixed = layer.double().mean(1) + eye  # (B, T, T)
        rollout = (mixed / mixed.sum(-1, keepdim=True)) @ rollout
    return rollout.float()


@torch.no_grad()
def rollout_maps(backbone: ViT, images: Tensor) -> Tensor:
    """images: (B, 3, H, W) normalised -> (B, gh, gw) the rollout of the pooled output over the patches:
    the [class] token's row, or for global-average-pooling backbones (no [class] token) the mean of
    the patch rows, which is what their pooled output averages. Each map sums to at most 1 (the rest
    stays on the [class] token). The backbone should be in eval mode."""
    device = next(backbone.parameters()).device
    prefix = backbone.num_prefix_tokens
    with AttentionRecorder(backbone) as recorder:
        backbone.forward_tokens(images.to(device))
        rollout = attention_rollout(recorder.probs)  # (B, T, T)
    rows = rollout[:, 0] if backbone.cls_token is not None else rollout[:, prefix:].mean(1)
    return rows[:, prefix:].reshape(len(images), *backbone.grid_size).cpu()
