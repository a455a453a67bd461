"""`kind: attentive_probe`: learned queries over every frozen token, a grid of lrs x weight decays trained
in one pass and chosen on held-out training images, never on the test labels; tokens cached once with
the `eval` augmentation, streamed through the frozen backbone otherwise."""

import json

import numpy as np
import pytest
import torch
import yaml
from cli_helpers import run_cli

from ssl_vit.data.convert.digits import load as digits
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks.attentive_probe import AttentiveProbe

BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}
ATTENTIVE = {"name": "attentive", "kind": "attentive_probe", "epochs": 3, "batch_size": 64, "heads": 4,
             "lrs": [1.0e-3, 1.0e-2], "weight_decays": [0.0, 0.1], "augmentation": "eval"}  # fmt: skip


def write_suite(path, train, test, protocols, **data):
    suite = {
        "backbone": BACKBONE,
        "data": {"train_urls": str(train), "test_urls": str(test), "image_size": 32, "batch_size": 64,
                 "num_workers": 0, **data},
        "resamples": 200,
        "protocols": protocols,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(suite))
    return path


def test_the_probe_attends_over_every_token_and_only_its_heads_train(digits_batch):
    config = ViTConfig(**BACKBONE)
    probe = AttentiveProbe(
        config, num_classes=10, queries=2, heads=4, lrs=[1e-3, 1e-2], weight_decays=[0.0, 0.1]
    )
    tokens = probe.features(digits_batch["image"])
    assert tokens.shape == (16, 1 + 16, 32)  # [class] token and 4 x 4 patches
    logits = probe.classify(tokens)
    assert logits.shape == (2, 16, 10) and torch.all(logits == 0)  # zero-initialised heads
    groups = probe.param_groups()
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-3, 0.0), (1e-2, 0.1)]
    trainable = {id(p) for g in groups for p in g["params"]}
    assert trainable == {id(p) for p in probe.parameters() if p.requires_grad}
    assert not any(p.requires_grad for p in probe.backbone.parameters())
    # the queries move the output: with the head trained one step, each probe pools differently
    loss = probe.forward_loss(probe.classify(tokens), digits_batch["label"])
    loss.backward()
    assert all(p.grad is not None for g in groups for p in g["params"][-2:])  # the linear head first


@pytest.fixture(scope="module")
def permuted_test(tmp_path_factory):
    """The digits' val images with their labels permuted: the same images, other test labels."""
    root = tmp_path_factory.mktemp("permuted")
    _, records = digits("", "val")
    images = np.stack([image for image, _ in records])
    labels = np.random.default_rng(0).permutation([label for _, label in records])
    np.savez(root / "permuted.npz", images=images, labels=labels)
    run_cli("data", "convert", f"npz:{root / 'permuted.npz'}", str(root / "shards"), "--split", "test",
            "--shard-size", "100", "--no-progress")  # fmt: skip
    return root / "shards" / "test-{000000..000003}.tar"


@pytest.mark.slow
@pytest.mark.parametrize("augmentation", ["eval", "pretrain"])
def test_the_choice_does_not_depend_on_the_test_labels(augmentation, digits_shards, permuted_test, tmp_path):
    """The same grid on the same training images, scored once on the real test labels and once on
    permuted ones: the same candidate is chosen (on held-out training images), the scores differ."""
    train, test = digits_shards / "train-{000000..000004}.tar", digits_shards / "val-{000000..000003}.tar"
    protocol = {**ATTENTIVE, "augmentation": augmentation, "epochs": 2 if augmentation == "eval" else 1}
    records = []
    for name, test_urls in (("real", test), ("permuted", permuted_test)):
        suite = write_suite(tmp_path / f"{name}.yaml", train, test_urls, [protocol])
        run_cli("evaluate", "scratch", "--suite", str(suite), "--out", str(tmp_path / name))
        records.append(json.loads((tmp_path / name / "results.json").read_text()))
    real, permuted = (record["details"]["attentive"] for record in records)
    chosen = ("best_lr", "best_weight_decay", "selection", "selected_on", "selection_images")
    assert {k: real[k] for k in chosen} == {k: permuted[k] for k in chosen}, (real, permuted)
    assert set(real["selection"]) == {"lr0.001_wd0", "lr0.001_wd0.1", "lr0.01_wd0", "lr0.01_wd0.1"}
    assert real["selected_on"] == "train_urls (held out)" and real["selected_by"] == "accuracy"
    assert records[0]["results"]["attentive"] != records[1]["results"]["attentive"]
    # the real labels are learnt from a random backbone's tokens (10 classes: chance is 0.1)
    assert records[0]["results"]["attentive"] > (0.3 if augmentation == "eval" else 0.12)
    assert records[0]["metrics"]["attentive"] == "accuracy"
    interval = records[0]["intervals"]["attentive"]
    assert interval["low"] < records[0]["results"]["attentive"] < interval["high"]
    assert len(real["loss_curve"]) >= 2 and real["loss_curve"][-1][1] < real["loss_curve"][0][1]
    # trained on cached tokens, the record keeps the chosen head's curve and says whether it levelled
    # off; trained on the stream, the heads' mean, with nothing said about it
    assert all(isinstance(loss, float) for _, loss in real["loss_curve"])
    cached = augmentation == "eval" and len(real["loss_curve"]) >= 10
    assert ("loss_change_last_fifth" in real) == cached, real


@pytest.mark.parametrize(
    "keys, words",
    [
        ({"heads": 5}, ["heads 5 does not divide the backbone's width 32"]),
        ({"weight_decay": 0.1}, ["weight_decay is one value", "weight_decays: [0.1]"]),
        ({"weight_decays": [0.1, 0.1]}, ["weight_decays [0.1, 0.1] repeat"]),
        ({"feature": "cls"}, ["feature is 'cls'", "'tokens' or 'patches'"]),
        ({"queries": 0}, ["queries is 0", "greater than 0"]),
        ({"lr": 0.1}, ["unknown keys ['lr']", "lrs"]),
    ],
    ids=["heads", "one-weight-decay", "repeat", "feature", "queries", "lr"],
)
def test_attentive_key_mistakes_are_one_line_and_write_nothing(keys, words, digits_shards, tmp_path, cli):
    train, test = digits_shards / "train-000000.tar", digits_shards / "val-000000.tar"
    suite = write_suite(tmp_path / "s.yaml", train, test, [{**ATTENTIVE, **keys}])
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"ssl-vit: error: {suite}: protocol 'attentive'"), proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert not out.exists()


def test_a_token_cache_larger_than_memory_allows_is_refused_before_its_pass(digits_shards, tmp_path, cli):
    """The cache's share of free memory set to almost nothing (as a machine without room for it):
    one line naming the size and the fix, nothing written."""
    train, test = digits_shards / "train-000000.tar", digits_shards / "val-000000.tar"
    suite = write_suite(tmp_path / "s.yaml", train, test, [ATTENTIVE])
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out), check=False,
               prelude="import ssl_vit.evaluation.cache as c; c.CACHE_SHARE = 1e-12")  # fmt: skip
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert "caching the tokens of the 300 images of train_urls takes" in proc.stderr
    assert "an augmentation other than 'eval'" in proc.stderr
    assert not out.exists()


def test_the_token_cache_counts_the_page_cache_as_memory_it_can_have(digits_shards, tmp_path, cli):
    """A host whose memory is nearly all page cache (a node that has just read its shards): free pages
    (here made one page) are not what the cache may use; the memory the kernel can give, which counts the
    cache it drops on demand, is. The token cache is built and the suite runs."""
    train, test = digits_shards / "train-000000.tar", digits_shards / "val-000000.tar"
    suite = write_suite(tmp_path / "s.yaml", train, test, [ATTENTIVE])
    one_free_page = (
        "import os; sysconf = os.sysconf; "
        "os.sysconf = lambda name: 1 if name == 'SC_AVPHYS_PAGES' else sysconf(name)"
    )
    proc = cli(
        "evaluate", "scratch", "--suite", str(suite), "--out", str(tmp_path / "out"), prelude=one_free_page
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "results.json").exists()


def test_the_folded_pooling_is_the_attention_of_projected_keys_and_values():
    """The pooling folds the query into the key matrix and applies the value matrix after pooling; it
    must equal the textbook form (every token projected to keys and values, scaled dot-product
    attention per head, the queries' outputs averaged), outputs and gradients alike."""
    import torch.nn.functional as F

    from ssl_vit.tasks.attentive_probe import AttentivePooling

    torch.manual_seed(0)
    pool = AttentivePooling(width=12, heads=3, queries=2)
    tokens = torch.randn(5, 7, 12, requires_grad=True)
    b, t, d, h = 5, 7, 12, 3
    q = pool.latent.view(1, 2, h, d // h).transpose(1, 2).expand(b, -1, -1, -1)  # (B, h, Q, d/h)
    k = pool.k(tokens).view(b, t, h, d // h).transpose(1, 2)  # (B, h, T, d/h)
    v = pool.v(tokens).view(b, t, h, d // h).transpose(1, 2)
    expected = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, 2, d).mean(1)
    found = pool(tokens)
    assert torch.allclose(found, expected, atol=1e-6)
    grads = torch.autograd.grad(found.square().sum(), [tokens, pool.latent, pool.k.weight, pool.v.weight])
    wanted = torch.autograd.grad(expected.square().sum(), [tokens, pool.latent, pool.k.weight, pool.v.weight])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, wanted))
