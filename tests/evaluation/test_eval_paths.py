"""What `evaluate` is given: a folder where it expects a file is named as a folder, not as missing;
a suite's data block the backbone cannot take is refused when the suite is read."""

from pathlib import Path

import pytest
import yaml
from test_errors import error_line

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "recipes/eval/quickstart.yaml"


def test_a_folder_given_as_the_checkpoint_or_the_suite(tmp_path, cli):
    folder = tmp_path / "run"
    folder.mkdir()
    out = tmp_path / "out"
    proc = cli("evaluate", str(folder), "--suite", str(SUITE), "--out", str(out), check=False)
    error_line(proc, f"checkpoint '{folder}' is a folder without model.safetensors", ".ckpt")
    proc = cli("evaluate", "scratch", "--suite", str(folder), "--out", str(out), check=False)
    error_line(proc, f"suite {folder} is a directory", "give a suite file")
    assert not out.exists()


@pytest.mark.parametrize(
    "data, words",
    [
        (
            {"image_size": 34},
            ["data: image_size 34 is not a multiple of the backbone's patch size 4", "such as 32"],
        ),
        ({"batch_size": "big"}, ["data: batch_size is 'big'", "integer of at least 1"]),
        ({"batch_size": 0}, ["data: batch_size is 0", "integer of at least 1"]),
        ({"num_workers": -1}, ["data: num_workers is -1", "integer of at least 0"]),
    ],
)
def test_a_suite_whose_data_the_backbone_cannot_take(tmp_path, cli, data, words):
    """Refused when the suite is read, before any checkpoint is loaded or any output written."""
    suite = yaml.safe_load(SUITE.read_text())
    suite["data"].update(data)
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    proc = cli("evaluate", "scratch", "--suite", str(path), "--out", str(out), check=False)
    error_line(proc, *words)
    assert not out.exists()
