"""What `ssl-vit export` writes carries the SHA-256 of its config and tensors (a folder's, of its
config.json too) in its safetensors metadata; the loader checks it, so a damaged export is refused in one
line instead of scoring at chance. Files without one (another tool's) load as they are, and `ssl-vit info`
says they were not verified. Through the CLI, as users run it."""

import json
import struct
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from safetensors.torch import load_file, save_file
from test_errors import error_line, write_suite

from ssl_vit.checkpoints import load_backbone
from ssl_vit.checkpoints.load import METADATA_KEY

BACKBONE = {"variant": "S/8", "img_size": 32, "width": 64, "depth": 2, "heads": 2}  # conftest's CUSTOM


def exported(trained, tmp_path: Path, fmt: str) -> tuple[Path, Path]:
    """`custom_mpp` exported in `fmt`: (what the user names, the .safetensors file in it)."""
    out = tmp_path / ("mpp.safetensors" if fmt == "timm" else "mpp")
    run_cli("export", str(trained["custom_mpp"][0]), str(out), "--format", fmt)
    return out, out if fmt == "timm" else out / "model.safetensors"


def flip_tensor_bytes(path: Path, count: int = 32) -> None:
    """Invert `count` bytes (8 float32s) in the middle of a .safetensors' data, after its header."""
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    middle = start + (len(data) - start) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", ["timm", "hf"])
def test_flipped_bytes_in_an_export_are_one_damaged_line_for_evaluate_and_info(
    trained, digits_shards, tmp_path, fmt
):
    out, weights = exported(trained, tmp_path, fmt)
    info = run_cli("info", str(out)).stdout
    assert "verified by the SHA-256" in info and "ssl-vit export wrote" in info, info
    flip_tensor_bytes(weights)
    suite = write_suite(tmp_path / "suite.yaml", digits_shards, backbone=BACKBONE)
    proc = run_cli(
        "evaluate", str(out), "--suite", str(suite), "--out", str(tmp_path / "scores"), check=False
    )
    error_line(
        proc, f"{out} is damaged (", "do not match the SHA-256 ssl-vit export wrote", "export it again"
    )
    assert not (tmp_path / "scores").exists()
    error_line(run_cli("info", str(out), check=False), f"{out} is damaged (")


def test_a_changed_config_json_of_an_exported_folder_is_one_damaged_line(trained, tmp_path):
    out, _ = exported(trained, tmp_path, "hf")
    config = json.loads((out / "config.json").read_text())
    config["pretrained_cfg"]["mean"] = [0.0, 0.0, 0.0]  # what timm would normalise its inputs with
    (out / "config.json").write_text(json.dumps(config))
    line = error_line(run_cli("info", str(out), check=False))
    damaged = f"ssl-vit: error: {out} is damaged (its config.json does not match the SHA-256 ssl-vit export"
    assert line.startswith(damaged), line
    assert (out / "config.json").read_text() == json.dumps(config)  # refused, left as it was


def test_an_export_without_a_checksum_loads_as_today_and_info_says_it_was_not_verified(trained, tmp_path):
    out, weights = exported(trained, tmp_path, "hf")
    expected, _ = load_backbone(str(out))
    # as another tool writes it: the config metadata at most, no checksum
    metadata = {METADATA_KEY: json.dumps(BACKBONE | {"pooling": "cls"})}
    save_file(load_file(weights), weights, metadata=metadata)
    vit, _ = load_backbone(str(out))
    for (name, got), want in zip(vit.state_dict().items(), expected.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, msg=name)
    info = run_cli("info", str(out)).stdout
    assert "not verified: it carries no checksum" in info, info
    assert "backbone: S/8 (width 64, depth 2, heads 2, mlp_dim 256), 32 px, cls pooling" in info, info
