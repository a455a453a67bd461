"""A folder where `evaluate` expects a file: the line says it is a folder, not that it is missing."""

from pathlib import Path

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
