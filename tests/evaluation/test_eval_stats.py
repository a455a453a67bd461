"""Intervals and paired differences (`ssl_vit.evaluation.stats`) on synthetic features of known accuracy."""

import pytest
import torch

from ssl_vit.evaluation.fewshot import fewshot_correct
from ssl_vit.evaluation.kinds import KNNProtocol
from ssl_vit.evaluation.knn import knn_correct
from ssl_vit.evaluation.stats import Difference, Interval, Score, interval, paired_difference
from ssl_vit.evaluation.stats import interval as interval_
from ssl_vit.evaluation.stats import paired_difference as paired_
from ssl_vit.evaluation.suite import Suite
from ssl_vit.models.vit import ViTConfig
from ssl_vit.report.tables import markdown_table

TRUE_ACCURACY = 0.8


def synthetic(generator, n):
    """Two far-apart Gaussian clusters, each test label flipped with probability 1 - TRUE_ACCURACY:
    any sensible classifier predicts the cluster, so its expected accuracy is exactly TRUE_ACCURACY."""
    cluster = torch.randint(2, (n,), generator=generator)
    x = torch.randn(n, 8, generator=generator) + 20.0 * cluster[:, None]
    flipped = torch.rand(n, generator=generator) > TRUE_ACCURACY
    return x, torch.where(flipped, 1 - cluster, cluster)


@pytest.mark.parametrize("protocol", ["knn", "fewshot"])
def test_the_95_interval_covers_the_true_accuracy_about_95_times_in_100(protocol):
    covered = 0
    for repeat in range(100):
        generator = torch.Generator().manual_seed(repeat)
        train_x, train_y = synthetic(generator, 200)
        train_y = (train_x[:, 0] > 10).long()  # a clean training set: the clusters' own labels
        test_x, test_y = synthetic(generator, 200)
        if protocol == "knn":
            correct = knn_correct(train_x, train_y, test_x, test_y, k=5)[None, None]  # (1, 1, M)
        else:
            hits = fewshot_correct(train_x, train_y, test_x, test_y, shots=(5,), seeds=(0, 1, 2))[5]
            correct = hits[None]  # (1, 3, M)
        found = interval(Score.of_correct(correct), resamples=500, seed=repeat)
        assert found.low <= found.mean <= found.high
        covered += found.low <= TRUE_ACCURACY <= found.high
    assert 88 <= covered <= 100, covered


def test_an_interval_is_seeded_and_its_spreads_are_the_stds_across_seeds_and_runs():
    correct = torch.rand(2, 3, 50, generator=torch.Generator().manual_seed(0)) > 0.4
    score = Score.of_correct(correct)
    assert interval(score, seed=1) == interval(score, seed=1)
    assert interval(score, seed=1) != interval(score, seed=2)
    found = interval(score)
    assert found.mean == pytest.approx(correct.double().mean().item())
    assert found.seed_std == pytest.approx(correct.double().mean((0, 2)).std(correction=0).item())
    assert found.run_std == pytest.approx(correct.double().mean((1, 2)).std(correction=0).item())


def test_replicate_runs_aggregate_and_their_spread_widens_the_interval():
    """A group of two runs, one right on 90% of the images, one on 50%: the mean is their mean, and the
    interval covers the spread between runs, far wider than either run's own."""
    images = torch.arange(400)
    good, poor = (images % 10 != 0)[None], (images % 2 == 0)[None]  # (1, M): 90% and 50%
    group = torch.stack([good, poor])  # (2, 1, M)
    found = interval(Score.of_correct(group))
    assert found.mean == pytest.approx(0.7) and found.run_std == pytest.approx(0.2)
    alone = interval(Score.of_correct(good))
    assert found.high - found.low > 4 * (alone.high - alone.low)
    assert found.low < 0.6 and found.high > 0.8


def test_a_checkpoint_against_itself_differs_by_exactly_zero():
    correct = torch.rand(1, 3, 200, generator=torch.Generator().manual_seed(0)) > 0.3
    difference = paired_difference(Score.of_correct(correct), Score.of_correct(correct.clone()))
    assert (difference.mean, difference.low, difference.high) == (0.0, 0.0, 0.0)
    assert difference.verdict == "noise"


def test_paired_differences_win_lose_or_are_noise():
    def paired_difference(a, b):
        return paired_(Score.of_correct(a), Score.of_correct(b))

    def interval(a):
        return interval_(Score.of_correct(a))

    generator = torch.Generator().manual_seed(0)
    base = torch.rand(1, 1, 500, generator=generator) > 0.5
    better = base | (torch.rand(1, 1, 500, generator=generator) > 0.8)  # right wherever base is, and more
    assert paired_difference(better, base).verdict == "win"
    assert paired_difference(base, better).verdict == "loss"
    noisy = base ^ (torch.rand(1, 1, 500, generator=generator) > 0.98)  # a few flips both ways
    assert paired_difference(noisy, base).verdict == "noise"
    # Pairing: the same difference is beyond noise paired, within noise unpaired (independent images).
    shifted = base | (torch.rand(1, 1, 500, generator=generator) > 0.96)
    paired = paired_difference(shifted, base)
    unpaired = interval(shifted), interval(base)
    assert paired.verdict == "win" and unpaired[0].low < unpaired[1].high
    with pytest.raises(ValueError, match="same seeds and test images"):
        paired_difference(base, base[:, :, :10])


def test_the_differences_table_states_the_bounds_its_verdict_is_read_from():
    """A percentile interval need not be centred on its mean: -3.8 with bounds -8.2 and -0.04 is a
    loss, yet `-3.8 ± 4.1` would read as containing 0. The table prints the bounds themselves."""
    skewed = Difference(mean=-0.038, low=-0.0824, high=-0.0004, verdict="loss")
    assert skewed.mean + (skewed.high - skewed.low) / 2 > 0 > skewed.high  # its half-width
    row = {
        "name": "mpp",
        "runs": 1,
        "error": None,
        "cost": None,
        "intervals": {"knn": Interval(0.5, 0.4, 0.6, 0, 0)},
    }
    suite = Suite(ViTConfig("S/8", 32, width=32, depth=1, heads=2), {}, [KNNProtocol(name="knn", kind="knn")])
    table = markdown_table([row], ["knn"], suite, baseline="scratch", differences={"mpp": {"knn": skewed}})
    assert "| mpp | -3.8 [-8.2, -0.0] loss |" in table
    assert "| mpp | **50.0 ± 10.0** |" in table  # accuracies keep mean ± half-width (bold: the only row)


def test_an_miou_interval_resamples_images_and_is_the_ratio_of_summed_intersections_and_unions():
    """mIoU is not a mean of per-image IoUs: class 0's intersection over union is 1/1 in one image and
    0/2 in the other, 1/3 over both, not the mean of 1 and 0. Its interval comes from resampling images,
    as accuracy's does, and contains the estimate."""
    from ssl_vit.evaluation.segmentation import MIOU, PIXEL_ACCURACY, intersections_and_unions, pixel_counts

    predicted = torch.tensor([[[0, 1], [1, 1]], [[1, 1], [1, 1]]])  # (2 images, 2 x 2 pixels)
    masks = torch.tensor([[[0, 1], [1, 255]], [[0, 0], [1, 1]]], dtype=torch.uint8)
    stats = intersections_and_unions(predicted, masks, 2)  # (2, 4): hits of 0, 1, then unions of 0, 1
    assert stats.tolist() == [[1, 2, 1, 2], [0, 2, 2, 4]]
    score = Score(stats[None, None], MIOU)
    assert score.value() == pytest.approx((1 / 3 + 4 / 6) / 2)
    pixels = Score(pixel_counts(predicted, masks)[None, None], PIXEL_ACCURACY)
    assert pixels.value() == pytest.approx(5 / 7)  # the ignored pixel counts in neither
    many = Score(
        stats.repeat(50, 1)[None, None] + torch.rand(100, 4, generator=torch.Generator().manual_seed(0)), MIOU
    )
    found = interval(many, resamples=200)
    assert found.low < found.mean < found.high and found.high - found.low < 0.2
    assert paired_difference(many, many).mean == 0.0


def test_a_class_absent_from_a_resample_is_left_out_of_its_miou_not_counted_as_zero():
    from ssl_vit.evaluation.segmentation import MIOU

    only_one = torch.tensor([[1.0, 0.0, 2.0, 0.0]])  # class 1 has no pixel at all
    assert Score(only_one[None, None], MIOU).value() == pytest.approx(0.5)
