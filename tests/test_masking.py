"""Contracts of ssl_vit.masking: exact counts, disjoint covers, determinism, the 80/10/10 split, layout."""

import pytest
import torch
import torch.nn.functional as F

from ssl_vit.masking import (
    MASK,
    RANDOM,
    UNCHANGED,
    apply_bert_corruption,
    bert_corruption,
    block_mask,
    indices_to_mask,
    jepa_blocks,
    random_keep,
    simmim_mask,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_partition(idx_keep, idx_mask, batch_size, num_tokens, num_masked):
    assert idx_keep.dtype == idx_mask.dtype == torch.int64
    assert idx_keep.shape == (batch_size, num_tokens - num_masked)
    assert idx_mask.shape == (batch_size, num_masked)
    both = torch.cat([idx_keep, idx_mask], dim=1).sort(dim=1).values
    assert torch.equal(both, torch.arange(num_tokens).expand(batch_size, -1))  # disjoint and covering
    assert torch.equal(idx_mask, idx_mask.sort(dim=1).values)


def neighbour_rate(idx_mask, grid):
    """Share of masked tokens with a masked 4-neighbour."""
    m = indices_to_mask(idx_mask, grid[0] * grid[1]).view(-1, *grid)
    p = F.pad(m, (1, 1, 1, 1))
    has = p[:, :-2, 1:-1] | p[:, 2:, 1:-1] | p[:, 1:-1, :-2] | p[:, 1:-1, 2:]
    return ((has & m).sum() / m.sum()).item()


MASKERS = {
    "random_keep": lambda b, g: random_keep(b, 16, generator=g),
    "bert": lambda b, g: bert_corruption(b, 16, generator=g),
    "block": lambda b, g: block_mask(b, (4, 4), generator=g),
    "simmim": lambda b, g: simmim_mask(b, (4, 4), generator=g),
}


def test_indices_to_mask():
    mask = indices_to_mask(torch.tensor([[0, 2], [1, 3]]), 4)
    assert torch.equal(mask, torch.tensor([[True, False, True, False], [False, True, False, True]]))


@pytest.mark.parametrize("name", MASKERS)
def test_same_seed_same_mask_other_seed_differs(name):
    same = [MASKERS[name](8, gen(1)), MASKERS[name](8, gen(1))]
    other = MASKERS[name](8, gen(2))
    for a, b, _c in zip(*same, other):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, c) for a, c in zip(same[0], other))


@pytest.mark.parametrize("batch_size", [1, 64])
@pytest.mark.parametrize("num_tokens,ratio,num_masked", [(196, 0.75, 147), (10, 0.5, 5), (4, 1.0, 3)])
def test_random_keep_exact_partition(batch_size, num_tokens, ratio, num_masked):
    idx_keep, idx_mask = random_keep(batch_size, num_tokens, ratio, generator=gen())
    assert_partition(idx_keep, idx_mask, batch_size, num_tokens, num_masked)  # ratio 1 still keeps one


def test_random_keep_is_uniform():
    _, idx_mask = random_keep(4000, 8, 0.5, generator=gen())
    rate = indices_to_mask(idx_mask, 8).float().mean(dim=0)
    assert torch.allclose(rate, torch.full((8,), 0.5), atol=0.04)


@pytest.mark.parametrize("batch_size", [1, 64])
def test_bert_corruption_groups_partition_the_corrupted(batch_size):
    c = bert_corruption(batch_size, 20, generator=gen())
    assert c.idx_corrupt.shape == (batch_size, 10)
    groups = torch.cat([c.of(MASK), c.of(RANDOM), c.of(UNCHANGED)], dim=1).sort(dim=1).values
    assert torch.equal(groups, c.idx_corrupt)
    assert c.idx_corrupt.unique(dim=1).shape == c.idx_corrupt.shape  # no token twice
    assert c.group.shape == c.idx_corrupt.shape and c.random_source.shape == (*c.idx_corrupt.shape, 2)


@pytest.mark.parametrize("num_tokens", [16, 196])
def test_bert_split_is_80_10_10_over_draws(num_tokens):
    # 16 tokens -> C = 8, where fixed rounding would give 75/12.5/12.5.
    g = gen()
    counts = torch.zeros(3)
    for _ in range(2000):
        c = bert_corruption(2, num_tokens, generator=g)
        counts += torch.tensor([c.of(MASK).numel(), c.of(RANDOM).numel(), c.of(UNCHANGED).numel()])
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.8, 0.1, 0.1]), atol=0.01)


def test_bert_random_sources_are_other_patches_of_the_batch():
    batch_size, num_tokens = 4, 50  # every corrupted token random: 25 per sample
    draws = [
        bert_corruption(batch_size, num_tokens, mask_prob=0.0, random_prob=1.0, generator=gen(s))
        for s in range(40)
    ]
    idx_random = torch.cat([c.of(RANDOM) for c in draws])
    sample, token = torch.cat([c.random_source for c in draws]).unbind(-1)
    own = torch.arange(batch_size).repeat(len(draws))[:, None]
    assert sample.min() >= 0 and sample.max() < batch_size and token.min() >= 0 and token.max() < num_tokens
    assert not torch.any((sample == own) & (token == idx_random))  # never the slot itself
    from_other = (sample != own).float().mean().item()
    assert abs(from_other - 150 / 199) < 0.03  # uniform over the other 199 patches, 150 in other samples
    assert token.unique().numel() == num_tokens


def test_apply_bert_corruption_places_exactly_and_keeps_the_rest():
    batch_size, num_tokens, width = 3, 20, 5
    x = torch.randn(batch_size, num_tokens, width, requires_grad=True)
    x_before = x.detach().clone()
    mask_embedding = torch.randn(width, requires_grad=True)
    c = bert_corruption(batch_size, num_tokens, generator=gen())
    out = apply_bert_corruption(x, mask_embedding, c)

    rows = torch.arange(batch_size)[:, None]
    assert torch.equal(out[rows, c.of(MASK)], mask_embedding.detach().expand(*c.of(MASK).shape, width))
    source = c.of(RANDOM, c.random_source)
    assert torch.equal(out[rows, c.of(RANDOM)], x_before[source[..., 0], source[..., 1]])
    touched = indices_to_mask(torch.cat([c.of(MASK), c.of(RANDOM)], dim=1), num_tokens)
    assert torch.equal(out[~touched], x_before[~touched])  # unchanged ones included, bit-identical
    assert torch.equal(x.detach(), x_before)

    out.sum().backward()
    assert torch.equal(mask_embedding.grad, torch.full((width,), float(c.of(MASK).numel())))
    assert x.grad.abs().sum() > 0


@pytest.mark.parametrize("batch_size", [1, 64])
@pytest.mark.parametrize("grid,ratio,num_masked", [((14, 14), 0.4, 78), ((4, 6), 0.5, 12), ((3, 3), 1.0, 9)])
def test_block_mask_exact_partition(batch_size, grid, ratio, num_masked):
    idx_keep, idx_mask = block_mask(batch_size, grid, ratio, generator=gen())
    assert_partition(idx_keep, idx_mask, batch_size, grid[0] * grid[1], num_masked)


def test_block_mask_is_contiguous():
    grid = (14, 14)
    _, blocks = block_mask(256, grid, 0.4, generator=gen())
    _, scattered = random_keep(256, 196, 0.4, generator=gen())
    assert neighbour_rate(blocks, grid) > 0.97
    assert neighbour_rate(blocks, grid) > neighbour_rate(scattered, grid) + 0.1


@pytest.mark.parametrize("batch_size", [1, 64])
def test_simmim_mask_covers_whole_cells(batch_size):
    grid, s = (8, 6), 2
    idx_keep, idx_mask = simmim_mask(batch_size, grid, 0.6, s, generator=gen())
    assert_partition(idx_keep, idx_mask, batch_size, 48, round(0.6 * 12) * s * s)
    cells = indices_to_mask(idx_mask, 48).view(batch_size, 4, s, 3, s).permute(0, 1, 3, 2, 4).flatten(3)
    assert torch.all(cells.all(dim=-1) | ~cells.any(dim=-1))  # each 2x2 cell all masked or all kept


def test_simmim_mask_needs_a_divisible_grid():
    with pytest.raises(ValueError, match="not divisible"):
        simmim_mask(2, (7, 7), mask_patch_size_in_patches=2)


def test_bad_ratio_is_a_value_error():
    with pytest.raises(ValueError, match="mask_ratio"):
        random_keep(2, 10, 1.5)


@pytest.mark.parametrize("name", ["random_keep", "bert", "block", "simmim"])
def test_a_cpu_generator_draws_masks_for_another_device(name, monkeypatch):
    """Validation seeds masks with a CPU generator while the batch lives on the GPU; torch refuses a
    generator of another device. Emulate that check (there is no GPU here) on the `meta` device."""
    import ssl_vit.masking as masking

    def strict(fn):
        def call(*args, generator=None, device=None, **kwargs):
            if generator is not None and torch.device(device) != generator.device:
                raise RuntimeError(f"Expected a '{torch.device(device).type}' device type for generator")
            return fn(*args, generator=generator, device=device, **kwargs)

        return call

    monkeypatch.setattr(masking.torch, "rand", strict(torch.rand))
    monkeypatch.setattr(masking.torch, "randint", strict(torch.randint))
    fn = {
        "random_keep": lambda: random_keep(2, 16, generator=gen(), device="meta"),
        "bert": lambda: bert_corruption(2, 16, generator=gen(), device="meta"),
        "block": lambda: block_mask(2, (4, 4), generator=gen(), device="meta"),
        "simmim": lambda: simmim_mask(2, (4, 4), generator=gen(), device="meta"),
    }[name]
    out = fn()
    assert all(t.device.type == "meta" for t in out)


def test_jepa_blocks_have_the_papers_scales_and_aspects_and_the_context_never_sees_a_target():
    """I-JEPA: 4 targets of scale 0.15-0.2 and aspect (h / w) 0.75-1.5, one context block of scale
    0.85-1, less the targets; 300 seeded batches over a 14 x 14 grid (ViT-H/14 at 224 px)."""
    scales, aspects = [], []
    for seed in range(300):
        mask = jepa_blocks(4, (14, 14), generator=torch.Generator().manual_seed(seed))
        targets, context = mask.idx_targets, mask.idx_context
        assert targets.shape[:2] == (4, 4) and context.shape[0] == 4
        rows, cols = targets // 14, targets % 14
        h, w = rows.amax(-1) - rows.amin(-1) + 1, cols.amax(-1) - cols.amin(-1) + 1
        assert torch.equal(h * w, torch.full_like(h, targets.shape[-1]))  # whole rectangles, one size
        scales.append(targets.shape[-1] / 196)
        aspects += (h / w).flatten().tolist()
        # The context: at least 10 tokens (the paper's min_keep), distinct, sorted, inside a square of
        # at most 13 x 13 (a scale up to 1, kept below the grid's side), and no target token.
        assert context.shape[1] >= 10
        assert torch.equal(context, context.sort(1).values) and (context.diff(1) > 0).all()
        for sample in range(4):
            rows, cols = context[sample] // 14, context[sample] % 14
            assert rows.max() - rows.min() < 13 + 1 and cols.max() - cols.min() < 13 + 1
            assert not set(context[sample].tolist()) & set(targets[sample].flatten().tolist())
    # Rounding to whole patches widens the ranges a little, as in the paper's collator.
    assert 0.12 <= min(scales) and max(scales) <= 0.22 and 0.16 < sum(scales) / len(scales) < 0.185
    assert 0.7 <= min(aspects) < 0.8 and 1.4 < max(aspects) <= 1.8
    assert 1.05 < sum(aspects) / len(aspects) < 1.2  # U(0.75, 1.5) has mean 1.125


def test_jepa_blocks_are_seeded_and_drawn_off_the_step_device():
    def draw(seed):
        return jepa_blocks(8, (8, 8), generator=torch.Generator().manual_seed(seed))

    assert all(torch.equal(a, b) for a, b in zip(draw(3), draw(3)))
    assert not torch.equal(draw(3).idx_targets, draw(4).idx_targets)
    torch.manual_seed(0)
    default = jepa_blocks(2, (8, 8), device="meta")  # only the indices go to the device
    assert default.idx_context.device.type == "meta" and default.idx_targets.shape[:2] == (2, 4)
