"""Model selection never sees the test split: the linear probe's lr is chosen on images held out of its
labelled training images (or on val_urls), and the test split is read afterwards, by the chosen head."""

import json
from collections import Counter

import numpy as np
import pytest
import torch
import yaml
from cli_helpers import run_cli

from ssl_vit.data.convert.digits import load as digits
from ssl_vit.data.stream.pipeline import ShardStream
from ssl_vit.evaluation import scoring, selection, tables, training
from ssl_vit.evaluation.cache import FeatureCache
from ssl_vit.evaluation.kinds import probe_protocol as probe_kind
from ssl_vit.evaluation.stats import ACCURACY
from ssl_vit.evaluation.suite import evaluate, load_suite
from ssl_vit.evaluation.trained import label_subset, selection_split

BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}
LRS = [0.03, 0.3]


def write_suite(path, train, test, protocols_, val=None):
    data = {
        "train_urls": str(train),
        "test_urls": str(test),
        "image_size": 32,
        "batch_size": 64,
        "num_workers": 0,
    }
    if val is not None:
        data["val_urls"] = str(val)
    path.write_text(
        yaml.safe_dump({"backbone": BACKBONE, "data": data, "resamples": 100, "protocols": protocols_})
    )
    return path


def probe(augmentation="eval", **keys):
    return {"name": "linear", "kind": "linear_probe", "feature": "mean", "epochs": 2, "lrs": LRS,
            "augmentation": augmentation, **keys}  # fmt: skip


# --- the split -------------------------------------------------------------------------------------------


def test_selection_images_are_class_balanced_seeded_and_inside_the_labelled_subset():
    labels = torch.tensor([c for c, n in {0: 300, 1: 120, 2: 40, 3: 250}.items() for _ in range(n)])
    labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))]
    for fraction in (0.01, 0.1, 1.0):
        labelled = label_subset(labels, fraction, seed=0)
        train, select = selection_split(labels[labelled], 0.1, seed=0)
        train, select = labelled[train], labelled[select]
        # the 1% column selects on images among its 1% of the labels, apart from its training images
        assert set(select.tolist()) <= set(labelled.tolist()) and not set(select.tolist()) & set(
            train.tolist()
        )
        assert sorted(train.tolist() + select.tolist()) == labelled.tolist()
        per_class = Counter(labels[labelled].tolist())
        held = Counter(labels[select].tolist())
        # min(c - 1, max(1, round(0.1 c))) per class: a class of one labelled image trains on it
        assert held == {c: min(n - 1, max(1, round(0.1 * n))) for c, n in per_class.items() if n > 1}
        assert all(n >= 1 for n in Counter(labels[train].tolist()).values())
    assert torch.equal(selection_split(labels, 0.1, seed=0)[1], selection_split(labels, 0.1, seed=0)[1])
    assert not torch.equal(selection_split(labels, 0.1, seed=0)[1], selection_split(labels, 0.1, seed=1)[1])


# --- the test split is read after the choice -------------------------------------------------------------


@pytest.mark.parametrize("augmentation", ["eval", "pretrain"])
def test_the_test_split_is_read_once_and_only_after_the_lr_is_chosen(
    augmentation, digits_shards, tmp_path, monkeypatch
):
    """Every stream the evaluation opens and the selection itself, in order: no stream over the test
    shards before the choice, one after it; the training (Lightning, for `pretrain`) reads none."""
    events = []
    real_stream, real_choose = ShardStream.__init__, probe_kind.choose

    def stream(self, urls, *args, **kwargs):
        events.append(("stream", tuple(urls)))
        real_stream(self, urls, *args, **kwargs)

    def choose(protocol, selection, *args):
        events.append(("select", selection.shape[1]))
        return real_choose(protocol, selection, *args)

    monkeypatch.setattr(ShardStream, "__init__", stream)
    monkeypatch.setattr(probe_kind, "choose", choose)
    test = digits_shards / "val-{000000..000003}.tar"
    suite = write_suite(tmp_path / "s.yaml", digits_shards / "train-{000000..000004}.tar", test,
                        [probe(augmentation, label_fractions=[0.1, 1.0])])  # fmt: skip
    record = evaluate("scratch", load_suite(suite)).record
    test_shards = tuple(str(digits_shards / f"val-{i:06d}.tar") for i in range(4))
    test_reads = [i for i, event in enumerate(events) if event == ("stream", test_shards)]
    selections = [i for i, event in enumerate(events) if event[0] == "select"]
    assert len(selections) == 2 and len(test_reads) == 1, events  # one choice per fraction, one test pass
    assert test_reads[0] > selections[0], events
    # selected on a tenth of each fraction's labelled images, counted with its labels
    for column, labels in (("linear_10pct", 143), ("linear", 1438)):
        detail = record["details"][column]
        assert detail["selected_on"] == "train_urls (held out)" and detail["labels"] == labels
        assert detail["selection_images"] + detail["training_images"] == labels
        assert 0.08 * labels <= detail["selection_images"] <= 0.12 * labels
        assert detail["best_lr"] in LRS and set(detail["selection"]) == {"0.03", "0.3"}
        assert detail["selected_by"] == "accuracy"
    assert record["protocols"][0]["select_fraction"] == 0.1


def test_val_urls_are_the_selection_set_when_given(digits_shards, tmp_path):
    suite = write_suite(tmp_path / "s.yaml", digits_shards / "train-{000000..000004}.tar",
                        digits_shards / "val-{000002..000003}.tar", [probe()],
                        val=digits_shards / "val-{000000..000001}.tar")  # fmt: skip
    record = evaluate("scratch", load_suite(suite)).record
    detail = record["details"]["linear"]
    assert detail["selected_on"] == "val_urls" and detail["selection_images"] == 200
    assert detail["training_images"] == 1438 and detail["labels"] == 1438 + 200
    assert record["eval_view"]["data"] == {"train": "whole", "val": "whole", "test": "whole"}


def test_one_lr_chooses_nothing_and_trains_on_every_labelled_image(digits_shards, tmp_path, monkeypatch):
    monkeypatch.setattr(probe_kind, "choose", lambda *a: pytest.fail("nothing to choose"))
    suite = write_suite(tmp_path / "s.yaml", digits_shards / "train-{000000..000004}.tar",
                        digits_shards / "val-{000000..000003}.tar", [probe(lrs=[0.1])])  # fmt: skip
    detail = evaluate("scratch", load_suite(suite)).record["details"]["linear"]
    assert detail["training_images"] == detail["labels"] == 1438 and "selected_on" not in detail


# --- a case where the two choices differ -----------------------------------------------------------------


@pytest.fixture(scope="module")
def shifted_test(tmp_path_factory):
    """The digits' val images with every label moved to the next digit: a test split on which a head
    that predicts digit + 1 beats a head that reads digits right."""
    root = tmp_path_factory.mktemp("shifted")
    _, records = digits("", "val")
    images = np.stack([image for image, _ in records])
    labels = np.array([(label + 1) % 10 for _, label in records])
    np.savez(root / "shifted.npz", images=images, labels=labels)
    run_cli("data", "convert", f"npz:{root / 'shifted.npz'}", str(root / "shards"), "--split", "test",
            "--shard-size", "100", "--no-progress")  # fmt: skip
    return root / "shards" / "test-{000000..000003}.tar"


def test_held_out_selection_and_test_selection_pick_different_lrs(
    digits_shards, shifted_test, tmp_path, monkeypatch
):
    """The second head is made to predict the first head's digit + 1 (its weights rolled by one class).
    On held-out training digits the first head wins; on the shifted test split the second would. The
    protocol reports the first head's lr and its (poor) test accuracy: the test split chose nothing."""
    trained = []
    real = probe_kind.train_cached

    def train_then_roll(model, *args):
        metrics = real(model, *args)
        with torch.no_grad():
            model.heads[1].weight.copy_(model.heads[0].weight.roll(1, dims=0))
            model.heads[1].bias.copy_(model.heads[0].bias.roll(1, dims=0))
        trained.append(model)
        return metrics

    monkeypatch.setattr(probe_kind, "train_cached", train_then_roll)
    suite = load_suite(write_suite(tmp_path / "s.yaml", digits_shards / "train-{000000..000004}.tar",
                                   shifted_test, [probe(epochs=10)]))  # fmt: skip
    evaluation = evaluate("scratch", suite)
    detail = evaluation.record["details"]["linear"]
    assert detail["best_lr"] == LRS[0]
    assert detail["selection"]["0.03"] > detail["selection"]["0.3"]

    (model,) = trained
    # the test features the protocol scored, recomputed for the check, and the choice made on them
    (protocol,) = suite.protocols
    cache = FeatureCache(model.backbone, suite.backbone, suite.datasets["data"], ("mean",))
    on_test_stats = scoring.statistics([model], protocol, cache, "test", None, cached="mean")
    on_test, found = selection.choose(protocol, on_test_stats, ACCURACY, protocol.grid_axes())
    assert on_test == 1, found  # choosing on the test split would have picked the other lr
    assert found["selection"]["0.3"] > evaluation.record["results"]["linear"]
    assert evaluation.record["results"]["linear"] == pytest.approx(found["selection"]["0.03"])


# --- mistakes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "protocol, words",
    [
        (probe(select_fraction=1.0), "select_fraction is 1.0: input should be less than 1"),
        (probe(select_fraction=0), "select_fraction is 0: input should be greater than 0"),
    ],
)
def test_select_fraction_mistakes_are_one_line(protocol, words, digits_shards, tmp_path, cli):
    train, test = digits_shards / "train-000000.tar", digits_shards / "val-000000.tar"
    suite = write_suite(tmp_path / "s.yaml", train, test,
                        [protocol])  # fmt: skip
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr
    assert not out.exists()


def test_a_fraction_too_small_to_hold_images_out_is_one_line(digits_shards, tmp_path, cli):
    """0.1% of the digits is one image per class: none left to choose an lr on."""
    suite = write_suite(tmp_path / "s.yaml", digits_shards / "train-{000000..000004}.tar",
                        digits_shards / "val-000000.tar", [probe(label_fractions=[0.001])])  # fmt: skip
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out), check=False)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert "0.001 of the labels leaves one image per class" in proc.stderr and "val_urls" in proc.stderr
    assert not out.exists()
    assert json.loads((digits_shards / "train.json").read_text())["num_samples"] == 1438


# --- a chosen lr at the end of its grid ------------------------------------------------------------------


@pytest.mark.parametrize(
    "accuracy,head,edge",
    [
        ([0.2, 0.5, 0.9], 2, "largest"),
        ([0.9, 0.5, 0.2], 0, "smallest"),
        ([0.2, 0.9, 0.5], 1, None),  # inside the grid
        ([0.2, 0.9, 0.9], 1, None),  # the first of equals, inside
        ([0.9, 0.9, 0.2], 0, None),  # the end ties with its neighbour: nothing says the best lies beyond
        ([0.9], 0, None),  # a grid of one lr chooses nothing
    ],
)
def test_a_chosen_lr_that_ends_its_grid_and_beats_its_neighbour_is_an_edge(accuracy, head, edge):
    lrs = [0.01, 0.1, 1.0][: len(accuracy)]
    assert selection.grid_edge(lrs, accuracy, head) == edge
    shuffled = [1.0, 0.01, 0.1][: len(accuracy)]  # the grid's order is not the lrs' order
    moved = {0.01: 1, 0.1: 2, 1.0: 0} if len(accuracy) == 3 else {0.01: 0}
    reordered = [0.0] * len(accuracy)
    for lr, a in zip(lrs, accuracy, strict=True):
        reordered[moved[lr]] = a
    assert selection.grid_edge(shuffled, reordered, moved[lrs[head]]) == edge


def test_evaluate_notes_a_chosen_lr_at_the_top_of_its_grid(digits_shards, tmp_path, cli):
    """A grid whose largest lr is the best on the held-out images: results.json says so and `evaluate`
    prints one note on the grid on stderr saying what to do; the scores are written as usual."""
    suite = write_suite(tmp_path / "s.yaml", digits_shards / "train-{000000..000001}.tar",
                        digits_shards / "val-000000.tar", [probe(lrs=[1e-3, 1.0], epochs=5)])  # fmt: skip
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out))
    detail = json.loads((out / "results.json").read_text())["details"]["linear"]
    assert detail["best_lr"] == 1.0 and detail["lr_at_grid_edge"] == "largest", detail
    (note,) = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: note: linear: the lr")]
    assert note == (
        "ssl-vit: note: linear: the lr chosen on the held-out images is the grid's largest (1) in 1 of 1 "
        "run(s); a better one may lie above it: extend the protocol's lrs"
    )
    notes = tables.grid_edge_notes([{"details": {"linear": detail}}, {"details": {"linear": {
        **detail, "lr_at_grid_edge": None}}}])  # fmt: skip
    assert notes == [note.removeprefix("ssl-vit: note: ").replace("in 1 of 1", "in 1 of 2")]


def test_evaluate_notes_a_training_loss_still_falling_at_its_end_and_not_one_that_levelled_off(
    digits_shards, tmp_path, cli
):
    """A probe cut short at a constant lr (10 steps, `min_lr_ratio: 1`) still learns in its last fifth:
    results.json records the change and evaluate prints one note; 300 steps of the same probe level off
    and print none."""
    train, test = digits_shards / "train-{000000..000001}.tar", digits_shards / "val-000000.tar"
    found = {}
    for steps in (10, 300):
        suite = write_suite(tmp_path / f"s{steps}.yaml", train, test,
                            [probe(lrs=[0.3], steps=steps, min_lr_ratio=1.0, epochs=None)])  # fmt: skip
        out = tmp_path / f"out{steps}"
        proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out))
        detail = json.loads((out / "results.json").read_text())["details"]["linear"]
        losses = [loss for _, loss in detail["loss_curve"]]
        fifth = len(losses) // 5
        before, last = sum(losses[-2 * fifth : -fifth]) / fifth, sum(losses[-fifth:]) / fifth
        assert detail["loss_change_last_fifth"] == pytest.approx((last - before) / before, abs=1e-4)
        found[steps] = (detail["loss_change_last_fifth"], [
            line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: note:")])  # fmt: skip
    change, notes = found[10]
    assert change <= -0.1 and notes == [
        f"ssl-vit: note: linear: the training loss still fell by {-change:.0%} over the last "
        "fifth of its steps in 1 of 1 run(s): it had not levelled off; give it more steps (or epochs)"
    ], found
    change, notes = found[300]
    assert change > -0.1 and notes == [], found
    records = [{"details": {"linear": {"loss_change_last_fifth": c}}} for c in (-0.3, -0.12, 0.01)]
    assert tables.falling_loss_notes(records) == [
        "linear: the training loss still fell by 12%-30% over the last fifth of its steps in 2 of 3 run(s): "
        "it had not levelled off; give it more steps (or epochs)"
    ]


def test_a_probe_of_several_heads_keeps_the_chosen_heads_curve_and_judges_that_one():
    """`train_cached` records every head's loss; the record keeps the chosen head's: head 0 still falls
    16% over its last fifth (1.25 -> 1.05), head 1 is flat."""
    found = {"optimizer_steps": 10, "train_loss": [1.0, 0.7],
             "loss_curve": [[s, [round(2.0 - 0.1 * s, 5), 0.7]] for s in range(1, 11)]}  # fmt: skip
    first, second = training.for_head(found, 0), training.for_head(found, 1)
    assert first["train_loss"] == 1.0 and second["train_loss"] == 0.7
    assert first["loss_curve"] == [[s, round(2.0 - 0.1 * s, 5)] for s in range(1, 11)]
    assert first["loss_change_last_fifth"] == pytest.approx(-0.16)
    assert second["loss_curve"] == [[s, 0.7] for s in range(1, 11)]
    assert second["loss_change_last_fifth"] == 0.0
    assert training.levelling([[1, 2.0], [2, 1.0]]) == {"loss_curve": [[1, 2.0], [2, 1.0]]}  # too few points
