"""`decode: device`: the workers draw crops from JPEG headers, the batch is decoded where it lands. Run
here with the CPU as the device: the same code as on a GPU except for the CUDA stream handling."""

import io
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from cli_helpers import run_cli, start_cli
from PIL import Image
from resume_helpers import ROOT, fit_args, read_steps

from ssl_vit.benchmark.data import make_jpegs
from ssl_vit.data.datamodule import ShardDataModule
from ssl_vit.data.options import Augment, Stream, grouped
from ssl_vit.errors import BadValue

SIZE = 32


def _write(path, samples):
    with wds.TarWriter(str(path)) as sink:
        for i, (ext, data) in enumerate(samples):
            sink.write({"__key__": f"s{i:04d}", ext: data, "cls": str(i % 3).encode()})


def _png(seed):
    pixels = np.random.default_rng(seed).integers(0, 255, (60, 80, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _cmyk(jpeg):
    buf = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).convert("CMYK").save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Two shards of real photographs (scikit-image's, re-encoded at 96x72): JPEGs, plus PNGs and
    CMYK JPEGs (decoded on the CPU whatever `decode` says)."""
    root = tmp_path_factory.mktemp("photos")
    jpegs = make_jpegs(48, (96, 72), seed=1)
    for shard in range(2):
        part = jpegs[shard * 24 : (shard + 1) * 24]
        samples = [("jpg", j) for j in part[:20]] + [("png", _png(shard * 10 + k)) for k in range(2)]
        samples += [("jpg", _cmyk(j)) for j in part[20:22]]
        _write(root / f"train-{shard:06d}.tar", samples)
    return str(root / "train-{000000..000001}.tar")


def _batches(urls, decode, n=4, **kwargs):
    dm = ShardDataModule(
        train_urls=urls, batch_size=8, num_workers=0, image_size=SIZE, train_batches=n, decode=decode,
        augment=Augment(crop_scale=(0.2, 1.0), draft=False), stream=Stream(shuffle_buffer=16), **kwargs,
    )  # fmt: skip
    dm.setup("fit")
    loader = dm.train_dataloader()
    out = []
    for batch in loader:
        placed = dm.prepare_batch(batch)
        out.append((batch, placed))
    return out


def _pixels(placed):
    """Normalised floats back to 0-255 (ImageNet mean/std)."""
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return (placed["image"] * std + mean) * 255


def test_device_decoding_gives_the_cpu_paths_crops_and_flips(photos):
    cpu, device = _batches(photos, "cpu"), _batches(photos, "device")
    differences = []
    for (_, a), (raw, b) in zip(cpu, device, strict=True):
        assert a["key"] == b["key"] and torch.equal(a["label"], b["label"])
        assert b["image"].shape == a["image"].shape == (8, 3, SIZE, SIZE)
        jpeg = set(raw["jpeg_index"].tolist())
        for i in range(8):
            diff = (_pixels(a)[i] - _pixels(b)[i]).abs()
            if i in jpeg:
                differences.append(diff.mean().item())
                # A different box or flip gives differences of tens of levels on real photos; the same box
                # through another resampler (PIL's against torch's antialiased bilinear) and the same
                # libjpeg differs by rounding, about a level on average.
                assert diff.mean() < 2.0, (a["key"][i], diff.mean())
            else:  # PNG, CMYK: the CPU path in the worker, bit for bit
                assert diff.max() < 1e-3, a["key"][i]
    assert len(differences) > 20 and np.mean(differences) < 1.0


def test_samples_the_device_does_not_decode_are_counted(photos):
    device = _batches(photos, "device")
    on_cpu = sum(int(placed["decoded_on_cpu"]) for _, placed in device)
    not_jpeg = sum(len(raw["cpu_index"]) for raw, _ in device)
    assert on_cpu == not_jpeg > 0  # the PNGs and CMYK JPEGs drawn into these batches


def test_a_jpeg_no_decoder_reads_is_dropped_and_counted(tmp_path):
    good = make_jpegs(7, (96, 72), seed=2)
    broken = good[0][:200] + bytes(4000)  # a valid header, then nothing a decoder can use
    _write(tmp_path / "t-000000.tar", [("jpg", broken), *[("jpg", j) for j in good]])
    [(raw, placed)] = _batches(str(tmp_path / "t-000000.tar"), "device", n=1)
    assert len(raw["jpeg"]) == 8
    assert placed["image"].shape[0] == len(placed["label"]) == len(placed["key"]) == 7
    assert "s0000" not in placed["key"] and int(placed["skipped"]) == 1


def test_device_decoding_ships_compressed_bytes_not_pixels(photos):
    [(raw, _)] = _batches(photos, "device", n=1)
    assert all(isinstance(b, bytes) and b[:2] == b"\xff\xd8" for b in raw["jpeg"])
    assert raw["image"].shape[0] == len(raw["cpu_index"]) and raw["box"].shape == (len(raw["jpeg"]), 4)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"randaugment": "rand-m9-mstd0.5", "train_preset": "supervised"}, "RandAugment works on PIL images"),
        ({"train_preset": "eval"}, "'eval' resizes whole images"),
        ({"decode": "gpu"}, "decode must be 'cpu' or 'device'"),
    ],
)
def test_device_decoding_refuses_what_it_cannot_do(kwargs, says):
    with pytest.raises(BadValue, match=says):
        ShardDataModule(**grouped({"train_urls": "x.tar", "decode": "device", **kwargs}))


# --- through the CLI ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jpeg_digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("jpeg_digits")
    for split, size in (("train", "300"), ("val", "100")):
        args = ["--split", split, "--shard-size", size, "--format", "jpg", "--no-progress"]
        run_cli("data", "convert", "digits", str(out), *args)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_device_decoded_fit_stopped_and_resumed_equals_an_uninterrupted_one(jpeg_digits, tmp_path):
    env = {"PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    device = ("--data.init_args.decode", "device")
    reference = tmp_path / "reference.jsonl"
    run_cli(*fit_args(jpeg_digits, tmp_path / "reference", reference, *device, epochs=1), cwd=ROOT, env=env)
    expected = {r["step"]: r for r in read_steps(reference)}
    assert sorted(expected) == list(range(1, 7))

    run, record, release = tmp_path / "run", tmp_path / "run.jsonl", tmp_path / "release"
    args = fit_args(jpeg_digits, run, record, *device, epochs=1)
    hold = ["--trainer.callbacks+=resume_helpers.HoldAt", "--trainer.callbacks.release", str(release),
            "--trainer.callbacks.step", "3"]  # fmt: skip
    proc = start_cli(*args, *hold, cwd=ROOT, env=env, session=True)
    while not Path(f"{release}.reached").exists():
        assert proc.poll() is None, proc.wait().stderr[-3000:]
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=300).returncode == 128 + signal.SIGTERM

    run_cli(*args, "--ckpt_path", "last", cwd=ROOT, env=env)
    steps = read_steps(record)
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:
        assert r["loss"] == pytest.approx(expected[r["step"]]["loss"], abs=1e-6), r["step"]
        assert r["keys"] == expected[r["step"]]["keys"], r["step"]


def test_device_decoding_with_randaugment_is_one_line(jpeg_digits, tmp_path, cli):
    run = tmp_path / "run"
    proc = cli(
        "fit", "--config", str(ROOT / "recipes/quickstart/supervised.yaml"),
        "--data.init_args.train_urls", f"{jpeg_digits}/train-{{000000..000004}}.tar",
        "--data.init_args.val_urls", f"{jpeg_digits}/val-{{000000..000003}}.tar",
        "--data.init_args.augment.randaugment", "rand-m9-mstd0.5", "--data.init_args.decode", "device",
        "--trainer.default_root_dir", str(run), check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    assert len(errors) == 1 and "RandAugment works on PIL images: use decode 'cpu'" in errors[0]
    assert "Traceback" not in proc.stderr and not run.exists()
