"""Which patch tokens each masked-prediction objective hides: pure, seedable functions returning indices.

Every function takes a batch size and a token count (patch tokens only, no class token), draws from
`generator` (torch's default generator when None) and returns int64 index tensors on `device` (by
default the generator's device, else the CPU). Nothing loops over samples in Python: a mask for a
batch of 1 and of 4096 costs the same handful of kernels. Index rows are sorted
ascending, so they read in raster order; MAE's `ids_restore` is `torch.cat([keep, mask], 1).argsort(1)`.

Legend: B batch, N patches, D width, K kept, M masked, C corrupted.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from einops import repeat
from torch import Tensor


def _device(generator: torch.Generator | None, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return generator.device if generator is not None else torch.device("cpu")


def _rand(*shape: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """U[0, 1) of `shape` on `device`, drawn on the generator's own device: torch refuses a CPU
    generator for CUDA tensors, and validation draws its fixed masks from a seeded CPU generator."""
    source = device if generator is None else generator.device
    return torch.rand(*shape, generator=generator, device=source).to(device)


def _randint(high: int, shape, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """Like `_rand`, integers in [0, high)."""
    source = device if generator is None else generator.device
    return torch.randint(high, shape, generator=generator, device=source).to(device)


def _count(ratio: float, total: int, name: str) -> int:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {ratio}")
    return round(ratio * total)


def _mask_first(order: Tensor, num_masked: int) -> tuple[Tensor, Tensor]:
    """Split permutations `order` [B, N] into (idx_keep [B, N-M], idx_mask [B, M]): the first M are masked."""
    idx_mask, idx_keep = order.split([num_masked, order.shape[1] - num_masked], dim=1)
    return idx_keep.sort(dim=1).values, idx_mask.sort(dim=1).values


def indices_to_mask(idx: Tensor, num_tokens: int) -> Tensor:
    """Index rows `idx` [B, M] -> boolean mask [B, N], True at the listed (masked) tokens."""
    mask = torch.zeros(idx.shape[0], num_tokens, dtype=torch.bool, device=idx.device)
    return mask.scatter_(1, idx, True)


def random_keep(
    batch_size: int,
    num_tokens: int,
    mask_ratio: float = 0.75,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """MAE's uniform random masking (He et al. 2021, sec 3): argsort of uniform noise per sample.

    Returns (idx_keep [B, K], idx_mask [B, M]) with M = round(mask_ratio * N), capped so that K >= 1
    (the encoder needs at least one visible token).
    """
    device = _device(generator, device)
    num_masked = min(_count(mask_ratio, num_tokens, "mask_ratio"), num_tokens - 1)
    noise = _rand(batch_size, num_tokens, generator=generator, device=device)
    return _mask_first(noise.argsort(dim=1), num_masked)


# What each corrupted token becomes (`BertCorruption.group`).
MASK, RANDOM, UNCHANGED = 0, 1, 2


class BertCorruption(NamedTuple):
    """The ViT paper's corruption of one batch (sec 4.6, appendix B.1.2). The shapes are the same
    whatever the split, so a compiled step sees one shape and nothing is read to the host."""

    idx_corrupt: Tensor  # [B, C] sorted: every selected token, the ones the loss is computed on
    # [B, C] what each becomes: MASK (the learned [mask] embedding, 80%), RANDOM (another patch's, 10%)
    # or UNCHANGED (10%)
    group: Tensor
    # [B, C, 2] the (sample, token) whose patch embedding a RANDOM slot receives: any patch of the batch
    # but the slot itself (drawn for every slot, used by the RANDOM ones)
    random_source: Tensor

    def of(self, group: int, values: Tensor | None = None) -> Tensor:
        """`values` [B, C, ...] (default `idx_corrupt`) at one group's slots: [B, Cg, ...], every
        sample having the same count. Reads that count on the host: for inspection, not in a step."""
        values = self.idx_corrupt if values is None else values
        return values[self.group == group].unflatten(0, (self.group.shape[0], -1))


def bert_corruption(
    batch_size: int,
    num_tokens: int,
    corrupt_ratio: float = 0.5,
    mask_prob: float = 0.8,
    random_prob: float = 0.1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> BertCorruption:
    """ViT paper, appendix B.1.2: "corrupt 50% of patch embeddings by either replacing their embeddings
    with a learnable [mask] embedding (80%), a random other patch embedding (10%) or just keeping them
    as is (10%)".

    C = max(1, round(corrupt_ratio * N)) tokens per sample are chosen uniformly. The three groups have
    the same sizes in every sample of a call, and those sizes are rounded stochastically per call with
    a single shared draw u ~ U[0, 1):
        Cm = floor(mask_prob * C + u),  Cm + Cr = floor((mask_prob + random_prob) * C + u),  Cu = C - Cm - Cr.
    Since E[floor(a + u)] = a, the expected split is exactly 80/10/10 for any C, and each size is
    within one token of its exact share; fixed rounding would bias small C (C = 8 gives 75/12.5/12.5).
    u stays a tensor on the device: the chosen tokens, in their random order, take the groups by rank
    (the first Cm MASK, the next Cr RANDOM), so no size is ever read on the host.

    Random replacements copy a patch drawn uniformly from the other B*N - 1 patches of the batch
    (any sample, any position).
    """
    if mask_prob < 0 or random_prob < 0 or mask_prob + random_prob > 1:
        raise ValueError(f"need mask_prob, random_prob >= 0 with sum <= 1, got {mask_prob}, {random_prob}")
    if batch_size * num_tokens < 2:
        raise ValueError(
            "bert_corruption needs at least two patches in the batch to draw random replacements"
        )
    device = _device(generator, device)
    num_corrupt = max(1, _count(corrupt_ratio, num_tokens, "corrupt_ratio"))
    u = _rand(1, generator=generator, device=device)
    rank = torch.arange(num_corrupt, device=device)
    by_rank = (rank >= torch.floor(mask_prob * num_corrupt + u)).long()  # 0 MASK, 1 past the masked
    by_rank += rank >= torch.floor((mask_prob + random_prob) * num_corrupt + u)  # 2 UNCHANGED

    order = _rand(batch_size, num_tokens, generator=generator, device=device).argsort(dim=1)
    idx_corrupt, position = order[:, :num_corrupt].sort(dim=1)
    group = by_rank[position]

    # Uniform over the batch's patches minus the slot itself: draw among B*N - 1, skip over own index.
    own = torch.arange(batch_size, device=device)[:, None] * num_tokens + idx_corrupt
    flat = _randint(batch_size * num_tokens - 1, own.shape, generator=generator, device=device)
    flat = flat + (flat >= own).long()
    random_source = torch.stack([flat // num_tokens, flat % num_tokens], dim=-1)
    return BertCorruption(idx_corrupt, group, random_source)


def apply_bert_corruption(x: Tensor, mask_embedding: Tensor, c: BertCorruption) -> Tensor:
    """Corrupted copy of patch embeddings `x` [B, N, D] (before position embeddings, as in the paper).

    `mask_embedding` [D] goes to the MASK slots, the source patches of the uncorrupted `x` go to the
    RANDOM slots, every other value is untouched. `x` itself is not modified; gradients flow to both.
    """
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    group = c.group[..., None]
    other = x[c.random_source[..., 0], c.random_source[..., 1]]  # [B, C, D]
    value = torch.where(group == RANDOM, other, x[rows, c.idx_corrupt])
    value = torch.where(group == MASK, mask_embedding.to(x.dtype), value)
    out = x.clone()
    out[rows, c.idx_corrupt] = value
    return out


def block_mask(
    batch_size: int,
    grid: tuple[int, int],
    mask_ratio: float = 0.4,
    min_block: int = 4,
    max_block: int | None = None,
    aspect: tuple[float, float] = (0.3, 1 / 0.3),
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """BEiT's block-wise masking (Bao et al. 2021, Algorithm 1) with exactly M = round(mask_ratio * N)
    masked tokens per sample. Returns (idx_keep [B, N-M], idx_mask [B, M]) over the row-major `grid`.

    Like BEiT, each block has an area uniform in [min_block, max_block] (default M) and a log-uniform
    aspect ratio in `aspect`, and blocks are added in order until M tokens are masked. To vectorise over
    the batch, every sample draws ceil(M / min_block) blocks at once (enough to reach M without overlap)
    and a token's rank is the first block covering it; where BEiT rejects a block that overshoots, the
    last block used here is trimmed to the M - (already masked) tokens nearest its centre, so it stays
    a compact blob. Blocks are clipped to the grid; tokens no block covers are a random top-up if the
    blocks overlap too much to reach M.
    """
    device = _device(generator, device)
    height, width = grid
    num_masked = _count(mask_ratio, height * width, "mask_ratio")
    max_block = num_masked if max_block is None else max_block
    num_blocks = max(1, math.ceil(num_masked / min_block))

    def uniform(low: float, high: float) -> Tensor:  # [B, blocks, 1, 1], ready to broadcast over the grid
        u = _rand(batch_size, num_blocks, 1, 1, generator=generator, device=device)
        return low + (high - low) * u

    area = uniform(min_block, max(min_block, max_block))
    ratio = uniform(math.log(aspect[0]), math.log(aspect[1])).exp()
    h = (area * ratio).sqrt().round().clamp(1, height)
    w = (area / ratio).sqrt().round().clamp(1, width)
    top = (uniform(0, 1) * (height - h + 1)).floor()
    left = (uniform(0, 1) * (width - w + 1)).floor()

    rows = torch.arange(height, device=device, dtype=h.dtype)[:, None]  # [H, 1]
    cols = torch.arange(width, device=device, dtype=w.dtype)[None, :]  # [1, W]
    dy, dx = (rows - top - (h - 1) / 2) / h, (cols - left - (w - 1) / 2) / w  # in (-1/2, 1/2) inside
    inside = (dy.abs() < 0.5) & (dx.abs() < 0.5)  # [B, blocks, H, W]
    # rank = index of the first covering block + distance to its centre (< 1/2); uncovered: blocks + U[0, 1).
    first = inside.flatten(2).int().argmax(dim=1)  # [B, N]
    dist = (dy.square() + dx.square()).flatten(2).gather(1, first[:, None]).squeeze(1)
    top_up = num_blocks + _rand(batch_size, height * width, generator=generator, device=device)
    rank = torch.where(inside.flatten(2).any(dim=1), first + dist, top_up)
    return _mask_first(rank.argsort(dim=1), num_masked)


def simmim_mask(
    batch_size: int,
    grid: tuple[int, int],
    mask_ratio: float = 0.6,
    mask_patch_size_in_patches: int = 2,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """SimMIM's mask (Xie et al. 2022, sec 3.1): random cells of a coarser grid, each covering s x s
    patches (s = 2: SimMIM's 32-pixel cells over 16-pixel patches). round(mask_ratio * cells) cells are
    masked (SimMIM's code takes the ceiling; they differ by at most one cell), so M = that * s * s.
    Returns (idx_keep [B, N-M], idx_mask [B, M]) over the row-major `grid`.
    """
    s = mask_patch_size_in_patches
    height, width = grid
    if height % s or width % s:
        raise ValueError(f"grid {height}x{width} is not divisible by mask_patch_size_in_patches={s}")
    device = _device(generator, device)
    num_cells = (height // s) * (width // s)
    masked_cells = _count(mask_ratio, num_cells, "mask_ratio")
    noise = _rand(batch_size, num_cells, generator=generator, device=device)
    cells = indices_to_mask(noise.argsort(dim=1)[:, :masked_cells], num_cells)
    masked = repeat(cells, "b (h w) -> b (h s1 w s2)", w=width // s, s1=s, s2=s)
    return _mask_first(masked.int().argsort(dim=1, descending=True, stable=True), masked_cells * s * s)


def token_index(idx: Tensor, like: Tensor) -> Tensor:
    """Index rows `idx` [B, M] expanded to gather/scatter whole tokens of `like` [B, N, ...]."""
    return idx.view(*idx.shape, *([1] * (like.dim() - 2))).expand(*idx.shape, *like.shape[2:])


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """Tokens x [B, N, ...] at idx [B, M] -> [B, M, ...]."""
    return torch.gather(x, 1, token_index(idx, x))


class JepaMask(NamedTuple):
    """I-JEPA's masks for one batch (`jepa_blocks`)."""

    idx_context: Tensor  # [B, K] sorted: the context block less every target token, K the same for all
    idx_targets: Tensor  # [B, T, M] each block's h x w = M tokens, row-major (sorted)


def _block_size(
    scale: tuple[float, float], aspect: tuple[float, float], grid: tuple[int, int], u: Tensor
) -> tuple[int, int]:
    """(h, w) of a block covering about scale x N tokens with h / w = aspect, from two U[0, 1) draws `u`
    on the host; as I-JEPA's `_sample_block_size`: area int(N * scale), h = round(sqrt(area * aspect)),
    w = round(sqrt(area / aspect)), each kept below the grid's side."""
    height, width = grid
    area = int(height * width * (scale[0] + (scale[1] - scale[0]) * float(u[0])))
    ratio = aspect[0] + (aspect[1] - aspect[0]) * float(u[1])
    h, w = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
    return max(1, min(h, height - 1)), max(1, min(w, width - 1))


def _blocks(batch_size: int, count: int, size: tuple[int, int], grid: tuple[int, int], generator, source):
    """`count` blocks of `size` per sample at uniform positions -> token indices [B, count, h*w], sorted."""
    (h, w), (height, width) = size, grid
    top = torch.randint(height - h + 1, (batch_size, count, 1, 1), generator=generator, device=source)
    left = torch.randint(width - w + 1, (batch_size, count, 1, 1), generator=generator, device=source)
    rows = top + torch.arange(h, device=source)[:, None]  # [B, count, h, 1]
    cols = left + torch.arange(w, device=source)[None, :]  # [B, count, 1, w]
    return (rows * width + cols).flatten(2)


def jepa_blocks(
    batch_size: int,
    grid: tuple[int, int],
    num_targets: int = 4,
    target_scale: tuple[float, float] = (0.15, 0.2),
    target_aspect: tuple[float, float] = (0.75, 1.5),
    context_scale: tuple[float, float] = (0.85, 1.0),
    min_context: int = 10,
    tries: int = 20,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> JepaMask:
    """I-JEPA's multi-block masking (Assran et al. 2023, sec 3; `MaskCollator` in facebookresearch/ijepa,
    `src/masks/multiblock.py`): `num_targets` target blocks of scale `target_scale` and aspect ratio
    (h / w) `target_aspect`, and one context block of scale `context_scale` (aspect 1) from which every
    target token is removed, so the context never sees what it predicts.

    As in the paper's collator, one target size and one context size are drawn per call and shared by
    the batch, positions per sample and block; a context left with fewer than `min_context` tokens is
    drawn again (up to `tries` positions, else the one that kept most), and every context is cut to the
    batch's smallest count, so that the encoder sees one shape. The cut drops tokens at random (the
    paper's code keeps the first in raster order, which drops the bottom rows).

    The block sizes and that count are shapes, read on the host: everything is drawn on the generator's
    device, the CPU by default (the paper draws masks in its data loader too), and only the index
    tensors go to `device`, so a step on an accelerator never waits for its queue to drain.
    """
    source = generator.device if generator is not None else torch.device("cpu")
    device = torch.device(device) if device is not None else source
    height, width = grid
    sizes = torch.rand(4, generator=generator, device=source).cpu()
    target_size = _block_size(target_scale, target_aspect, grid, sizes[:2])
    context_size = _block_size(context_scale, (1.0, 1.0), grid, sizes[2:])
    idx_targets = _blocks(batch_size, num_targets, target_size, grid, generator, source)  # [B, T, M]
    candidates = _blocks(batch_size, tries, context_size, grid, generator, source)  # [B, tries, C]
    inside = torch.zeros(batch_size, tries, height * width, dtype=torch.bool, device=source)
    inside.scatter_(2, candidates, True)
    targets = indices_to_mask(idx_targets.flatten(1), height * width)  # [B, N]
    inside &= ~targets[:, None]
    counts = inside.sum(2)  # [B, tries]
    # The first position that keeps min_context tokens (the paper's retry loop), else the fullest.
    enough = counts >= counts.max(dim=1, keepdim=True).values.clamp(max=min_context)
    context = inside[torch.arange(batch_size, device=source), enough.int().argmax(1)]  # [B, N]
    keep = int(context.sum(1).min())
    if keep == 0:
        raise ValueError(f"grid {height}x{width} is too small for I-JEPA's blocks: no context token left")
    noise = torch.rand(batch_size, height * width, generator=generator, device=source)
    idx_context = (noise + (~context).float()).argsort(dim=1)[:, :keep].sort(dim=1).values
    return JepaMask(idx_context.to(device), idx_targets.to(device))
