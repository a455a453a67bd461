"""What `ssl-vit data inspect` checks, through the CLI: each shard against the manifest of its own
directory and split, labels against the manifest's class count, counts of empty, garbage and truncated
shards; an unbalanced brace in a URL pattern is one line; a label beyond the class count is a skipped
sample in training and validation."""

import json
import shutil

import webdataset as wds
from test_errors import ROOT, error_line, fit, listing

from ssl_vit.data.inspect import inspect_urls


def rewrite(src, dst, keep: int | None = None, labels: dict[int, str] | None = None) -> None:
    """Copy the shard `src` to `dst`: its first `keep` samples (all by default), with the `cls` of
    sample i set to `labels[i]`."""
    with wds.TarWriter(str(dst)) as sink:
        for i, sample in enumerate(wds.WebDataset(str(src), shardshuffle=False)):
            if i == keep:
                break
            sample = {k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")}
            sink.write({**sample, "cls": (labels or {}).get(i, sample["cls"])})


def edit_manifest(path, shard: str, num_samples: int) -> None:
    manifest = json.loads(path.read_text())
    (entry,) = [s for s in manifest["shards"] if s["url"] == shard]
    entry["num_samples"] = num_samples
    path.write_text(json.dumps(manifest))


def problems_of(proc) -> list[str]:
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    text = proc.stdout.split("problems:\n")
    return [line.strip() for line in text[1].splitlines()] if len(text) > 1 else []


def test_each_shard_is_checked_against_its_own_manifest(cli, digits_shards, tmp_path):
    # `other`: a second conversion whose val-000001.tar holds 50 samples, as its own manifest says;
    # `wrong`: a copy whose train manifest says 239 samples for train-000004.tar, which holds 238.
    other, wrong = tmp_path / "other", tmp_path / "wrong"
    shutil.copytree(digits_shards, other)
    rewrite(digits_shards / "val-000001.tar", other / "val-000001.tar", keep=50)
    edit_manifest(other / "val.json", "val-000001.tar", 50)
    shutil.copytree(digits_shards, wrong)
    edit_manifest(wrong / "train.json", "train-000004.tar", 239)

    urls = [digits_shards / "val-000001.tar", other / "val-000001.tar", wrong / "train-000004.tar"]
    proc = cli("data", "inspect", *map(str, urls), check=False)
    assert problems_of(proc) == [f"{wrong}/train-000004.tar: 238 samples, the manifest says 239"]
    assert proc.returncode == 1
    proc = cli("data", "inspect", *map(str, urls[:2]))  # two directories, each right by its own manifest
    assert "150 good samples in 2 shards, 10 classes, 0 problems" in proc.stdout


def test_a_label_beyond_the_class_count_is_a_problem_then_a_skipped_sample(cli, digits_shards, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(digits_shards / "val.json", shards)
    rewrite(digits_shards / "val-000003.tar", shards / "val-000003.tar", labels={0: "42"})
    proc = cli("data", "inspect", str(shards / "val-000003.tar"), check=False)
    assert proc.returncode == 1
    assert "58 good samples in 1 shards, 10 classes, 1 problems" in proc.stdout
    (problem,) = problems_of(proc)  # the count still matches the manifest's 59
    assert problem.startswith(f"{shards}/val-000003.tar: ") and "label 42 is beyond" in problem

    # MPP ignores labels; validation still reads them: the sample is skipped and counted, never fatal.
    proc = cli(
        "validate", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"), "--ckpt_path", "scratch",
        "--data.init_args.val_urls", str(shards / "val-000003.tar"),
        "--data.init_args.num_workers", "0", "--trainer.logger", "false",
        "--model.init_args.backbone.width", "32", "--model.init_args.backbone.depth", "1",
        cwd=tmp_path,
    )  # fmt: skip
    (row,) = [line for line in proc.stdout.splitlines() if "data/skipped_val" in line]
    assert row.split()[-2] == "1.0"
    assert "label 42 is beyond num_classes 10" in proc.stderr


def test_counts_of_empty_garbage_and_truncated_shards(cli, digits_shards, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(digits_shards, shards)
    (shards / "val-000000.tar").write_bytes(b"")
    (shards / "val-000001.tar").write_bytes(b"this is not a tar file\n" * 40)
    whole = (digits_shards / "val-000002.tar").read_bytes()
    (shards / "val-000002.tar").write_bytes(whole[: len(whole) // 3 // 512 * 512 + 100])  # mid-block
    proc = cli("data", "inspect", str(shards / "val-{000000..000002}.tar"), check=False)
    problems = problems_of(proc)
    assert f"{shards}/val-000000.tar: 0 samples, the manifest says 100" in problems
    assert f"{shards}/val-000001.tar: 0 samples, the manifest says 100" in problems
    (truncated,) = inspect_urls(str(shards / "val-000002.tar"))[0]
    assert 0 < truncated.samples < 100 and truncated.bad == [] and truncated.errors
    assert f"{shards}/val-000002.tar: {truncated.samples} samples, the manifest says 100" in problems


def test_an_unbalanced_brace_is_one_line(cli, digits_shards, tmp_path):
    pattern = f"{digits_shards}/val-{{000000..000003.tar"
    proc = cli("data", "inspect", pattern, check=False)
    error_line(proc, "Unbalanced braces", pattern, "close each '{' with '}'")
    assert proc.stdout == ""

    proc = fit(
        digits_shards, tmp_path, "--data.init_args.train_urls", f"{digits_shards}/train-000000..000004}}.tar"
    )
    error_line(proc, "Unbalanced braces", "train-000000..000004}.tar", "close each '{' with '}'")
    assert listing(tmp_path) == []
