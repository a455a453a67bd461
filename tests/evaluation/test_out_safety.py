"""What `ssl-vit evaluate` and `ssl-vit compare` may write: row names are plain folder names, --out is
checked before anything runs, replaced only with --overwrite and only once the new results are
complete, and compare names exactly the files it wrote."""

import json
from pathlib import Path

import pytest
import yaml
from cli_helpers import failing_evaluation, run_cli
from test_errors import error_line, listing

from ssl_vit.storage.outdir import MARKER

BACKBONE = {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2}


@pytest.fixture(scope="module")
def knn_suite(digits_shards, tmp_path_factory) -> Path:
    """A k-NN-only suite on a few hundred digits: seconds per checkpoint, no few-shot picture."""
    path = tmp_path_factory.mktemp("suite") / "knn.yaml"
    path.write_text(yaml.safe_dump({
        "backbone": BACKBONE,
        "data": {"train_urls": str(digits_shards / "val-00000{0..1}.tar"),
                 "test_urls": str(digits_shards / "val-00000{2..3}.tar"),
                 "image_size": 32, "num_workers": 0},
        "protocols": [{"name": "knn", "kind": "knn", "k": 5}],
        "resamples": 100,
    }))  # fmt: skip
    return path


def old_results(directory: Path) -> dict[str, str]:
    """An earlier run's files in `directory`, with the marker of an output of ssl-vit (which --overwrite
    may replace); returns them to compare against afterwards."""
    files = {"results.json": '{"old": true}\n', "results.csv": "old\n", "gone/results.json": "{}\n",
             MARKER: '{"command": "evaluate"}\n'}  # fmt: skip
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    return files


def unchanged(directory: Path, files: dict[str, str]) -> bool:
    return sorted(listing(directory)) == sorted({*files, "gone"}) and all(
        (directory / name).read_text() == text for name, text in files.items()
    )


@pytest.mark.parametrize(
    "row, words",
    [
        ("..", ["'..'", "not a plain name"]),
        (".", ["'.'", "not a plain name"]),
        ("x/y", ["'x/y'", "not a plain name"]),
        ("results.csv", ["'results.csv'", "a file compare writes"]),
        ("wandb", ["'wandb'", "a file compare writes"]),
    ],
)
def test_a_row_name_is_a_plain_folder_name(row, words, knn_suite, tmp_path):
    """`..=CKPT` would write results.json beside --out, `x/y=CKPT` nested folders, `results.csv=CKPT`
    a folder where the table goes."""
    (tmp_path / "results.json").write_text("mine\n")
    out = tmp_path / "out"
    proc = run_cli("compare", f"{row}=scratch", "--suite", str(knn_suite), "--out", str(out), check=False)
    error_line(proc, *words)
    assert listing(tmp_path) == ["results.json"] and (tmp_path / "results.json").read_text() == "mine\n"


def test_a_scratch_row_and_scratch_are_refused_together(knn_suite, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(
        "compare",
        "scratch=scratch",
        "--scratch",
        "2",
        "--suite",
        str(knn_suite),
        "--out",
        str(out),
        check=False,
    )
    error_line(proc, "'scratch'", "--scratch")
    assert not out.exists()


def out_args(command: str, out: Path, suite: Path) -> list[str]:
    source = "scratch" if command == "evaluate" else "a=scratch"
    return [command, source, "--suite", str(suite), "--out", str(out)]


@pytest.mark.parametrize("command", ["evaluate", "compare"])
def test_a_bad_out_is_refused_before_anything_runs(command, knn_suite, tmp_path):
    file = tmp_path / "file.txt"
    file.write_text("mine\n")
    for out, words in (
        (file, ["file.txt", "is a file"]),
        (file / "out", ["file.txt", "lies under the file"]),
        (Path("/proc/ssl-vit-out"), ["/proc/ssl-vit-out", "cannot be written"]),
        (Path("."), ["--out .", "holds the current directory"]),  # would be renamed away
    ):  # not even with --overwrite
        proc = run_cli(*out_args(command, out, knn_suite), "--overwrite", cwd=tmp_path, check=False)
        error_line(proc, *words)
    assert listing(tmp_path) == ["file.txt"] and file.read_text() == "mine\n"
    # An earlier run's results are kept without --overwrite.
    used = tmp_path / "used"
    files = old_results(used)
    error_line(run_cli(*out_args(command, used, knn_suite), check=False), "not empty", "--overwrite")
    assert unchanged(used, files)


def test_evaluate_overwrite_replaces_once_complete_and_a_failed_run_loses_nothing(knn_suite, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    files = old_results(out)
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"this is not a checkpoint")
    proc = run_cli(
        "evaluate", str(broken), "--suite", str(knn_suite), "--out", str(out), "--overwrite", check=False
    )
    assert proc.returncode != 0
    assert unchanged(out, files) and sorted(p.name for p in tmp_path.iterdir()) == ["broken.ckpt", "out"]
    proc = run_cli(*out_args("evaluate", out, knn_suite), "--overwrite")
    assert proc.stdout.splitlines()[-1] == f"wrote {out}/results.json"
    assert (
        listing(out) == [MARKER, "results.json"]
        and "knn" in json.loads((out / "results.json").read_text())["results"]
    )


@pytest.mark.slow
def test_compare_overwrite_holds_the_new_comparison_only_and_names_what_it_wrote(knn_suite, tmp_path):
    out = tmp_path / "out"
    args = ["--suite", str(knn_suite), "--out", str(out)]
    run_cli("compare", "old=scratch", "v1.2+ft_a-b=scratch", *args)
    assert (out / "old/results.json").is_file() and (out / "v1.2+ft_a-b/results.json").is_file()
    proc = run_cli("compare", "new=scratch", *args, "--overwrite")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["new", "wandb"]
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    # k-NN only: no few-shot picture, and the line names exactly the files there.
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    written = line.removeprefix(f"wrote {out}/").split(", ")
    assert "fewshot.png" not in written and {"results.csv", "bars.png", "attention_distance.png"} <= set(
        written
    )
    assert sorted(written) == sorted(p.name for p in out.iterdir() if p.is_file() and p.name != MARKER)


@pytest.mark.slow
def test_compare_with_every_row_failed_names_no_picture(knn_suite, tmp_path):
    """The only row's checkpoint loads, its evaluation fails (`failing_evaluation`)."""
    out = tmp_path / "out"
    proc = run_cli("compare", "broken=scratch", "--suite", str(knn_suite), "--out", str(out), check=False,
                   prelude=failing_evaluation("scratch"))  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    assert line == f"wrote {out}/results.csv, results.md, wandb-run.json"
    assert not list(out.glob("*.png"))
