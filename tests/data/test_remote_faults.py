"""Shards and manifests served by an HTTP server that fails on purpose (`faulty_http`: 503s, bodies cut
half way, stalls), read by `ssl-vit evaluate` and `ssl-vit fit` as a user runs them: a fault a retry
can mend gives exactly the numbers of a fault-free run; one it cannot ends the run with one line, exit
status 2, no traceback, and nothing written (an earlier `--out` kept as it was, no checkpoint)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from cli_helpers import run_cli

from ssl_vit.storage.outdir import mark

pytest_plugins = ["server_helpers"]  # the `faulty_http` fixture

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}  # resume_helpers.StepRecorder
# Small timeouts, so that a stall costs seconds: a read gives up after 2 s without a byte.
FAST = {"read_timeout_s": 2, "read_retries": 2}


def serve(server, digits_shards: Path) -> str:
    for path in digits_shards.iterdir():
        shutil.copy(path, server.root / path.name)
    return server.url


def one_line_failure(proc, *words: str) -> str:
    """The command failed with exit status 2 and no traceback; its last line on stderr is its only
    `ssl-vit: error:` line, naming `words` (the retries before it are logged as warnings)."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error: ")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr[-4000:]
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


# --- evaluate --------------------------------------------------------------------------------------------


def write_suite(path: Path, base: str, **data) -> Path:
    suite = {
        "backbone": {"variant": "S/8", "img_size": 32, "width": 32, "depth": 1, "heads": 2},
        "data": {
            "train_urls": f"{base}/train-{{000000..000004}}.tar",
            "test_urls": f"{base}/val-{{000000..000003}}.tar",
            "image_size": 32, "batch_size": 128, "num_workers": 0, **FAST, **data,
        },
        "protocols": [
            {"name": "fewshot", "kind": "fewshot", "shots": [1, 5], "seeds": [0, 1]},
            {"name": "knn", "kind": "knn", "k": 5},
        ],
        "resamples": 100,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(suite))
    return path


def evaluate(suite: Path, out: Path, *extra: str, timeout: float = 300):
    return run_cli("evaluate", "scratch", "--suite", str(suite), "--out", str(out), *extra, check=False,
                   timeout=timeout)  # fmt: skip


def scores(out: Path) -> dict:
    record = json.loads((out / "results.json").read_text())
    return {key: record[key] for key in ("results", "intervals", "details", "eval_view")}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluate_through_faults_a_retry_mends(faulty_http, digits_shards, tmp_path):
    """The first request of each manifest answers 503 or stalls, a shard is cut half way, another
    stalls half way: the scores, intervals and eval views equal a fault-free run's (the view of each
    split too: `whole`, the digits being stored at 32 px)."""
    base = serve(faulty_http, digits_shards)
    suite = write_suite(tmp_path / "suite.yaml", base)
    proc = evaluate(suite, tmp_path / "clean")
    assert proc.returncode == 0, proc.stderr[-4000:]
    clean = scores(tmp_path / "clean")
    assert clean["eval_view"] == {"data": {"train": "whole", "test": "whole"}}
    assert faulty_http.count(".json") == 2  # each manifest read once, for every decision taken from it

    faulty_http.fail("train.json", "503", 1)
    faulty_http.fail("val.json", "stall", 1)
    faulty_http.fail("train-000001.tar", "half", 1)
    faulty_http.fail("val-000002.tar", "stall_body", 1)
    faulty_http.fail("train-000003.tar", "503", 1, method="HEAD")  # the shard check at start-up
    proc = evaluate(suite, tmp_path / "faulty")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert scores(tmp_path / "faulty") == clean
    faults = [fault for _, _, fault in faulty_http.requests if fault]
    assert sorted(faults) == ["503", "503", "half", "stall", "stall_body"]  # every fault was met
    retried = set(re.findall(r"reading (http\S+) failed", proc.stderr))  # each retry is logged
    assert {url.rsplit("/", 1)[1] for url in retried} == {
        "train.json", "val.json", "train-000001.tar", "val-000002.tar", "train-000003.tar"
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluate_stops_with_one_line_when_a_manifest_cannot_be_read(faulty_http, digits_shards, tmp_path):
    """A manifest that answers 503 to every request is an error after the retries (never "no
    manifest", which would evaluate the digits through a resize and centre crop instead); a server
    that stalls on every manifest request the same, after its read timeouts. An earlier --out stays."""
    base = serve(faulty_http, digits_shards)
    suite = write_suite(tmp_path / "suite.yaml", base)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"earlier": true}\n')
    mark(out, "evaluate")  # an earlier output of ssl-vit, which alone --overwrite may replace

    faulty_http.fail("val.json", "503")
    proc = evaluate(suite, out, "--overwrite")
    one_line_failure(proc, f"manifest {base}/val.json exists but cannot be read", "HTTP 503", "tried 3 times")
    assert faulty_http.count("val.json") == 3
    assert json.loads((out / "results.json").read_text()) == {"earlier": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "suite.yaml", "www"]

    faulty_http.reset()
    faulty_http.fail("train.json", "stall")
    proc = evaluate(suite, out, "--overwrite")
    one_line_failure(proc, f"manifest {base}/train.json exists but cannot be read", "no byte for 2 s")
    assert json.loads((out / "results.json").read_text()) == {"earlier": True}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluate_stops_with_one_line_when_the_workers_deliver_nothing(faulty_http, digits_shards, tmp_path):
    """Every request for a test shard stalls; with a DataLoader worker, no batch within
    loader_timeout_s ends the run with one line naming the split's shards, and the stuck worker is
    stopped at once (the command ends within the test's timeout, not 60 s after the error)."""
    base = serve(faulty_http, digits_shards)
    suite = write_suite(tmp_path / "suite.yaml", base, num_workers=1, read_timeout_s=120, loader_timeout_s=3)
    faulty_http.fail("val-", "stall")
    proc = evaluate(suite, tmp_path / "out", timeout=50)
    one_line_failure(
        proc, "no batch from the 1 DataLoader worker(s) in 3 s while reading test_urls",
        f"{base}/val-000000.tar", "and 1 more", "loader_timeout_s",
    )  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("status", ["403", "405", "501"])
def test_evaluate_reads_shards_whose_server_refuses_head(faulty_http, digits_shards, tmp_path, status):
    """Presigned S3/GCS URLs answer HEAD with 403 (the signature is for GET), some servers have no HEAD
    (405, 501): the start-up check asks for one byte with a ranged GET instead, once per shard, and
    the shards are read; no retry of a status no retry mends."""
    base = serve(faulty_http, digits_shards)
    faulty_http.fail(".tar", status, method="HEAD")
    suite = write_suite(tmp_path / "suite.yaml", base, num_workers=0)
    proc = evaluate(suite, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed" not in proc.stderr, proc.stderr[-3000:]  # no retry line
    tars = sorted({path for _, path, _ in faulty_http.requests if path.endswith(".tar")})
    assert len(tars) == 9
    for path in tars:
        assert faulty_http.count(path, "HEAD") == 1  # refused once, not retried
    assert json.loads((tmp_path / "out/results.json").read_text())["results"]


def test_a_status_no_retry_mends_is_one_line_at_once(faulty_http, digits_shards, tmp_path):
    """A shard whose server answers 501 to HEAD and to GET: one line naming it, after one request of
    each (the retries are for a server's passing trouble, 503 and the like)."""
    base = serve(faulty_http, digits_shards)
    for method in ("HEAD", "GET"):
        faulty_http.fail("train-000002.tar", "501", method=method)
    suite = write_suite(tmp_path / "suite.yaml", base)
    proc = evaluate(suite, tmp_path / "out")
    one_line_failure(proc, f"shard {base}/train-000002.tar is unreachable (HTTP 501")
    assert "try 2 of" not in proc.stderr
    assert faulty_http.count("train-000002.tar", "HEAD") == faulty_http.count("train-000002.tar", "GET") == 1
    assert not (tmp_path / "out").exists()


# --- fit ------------------------------------------------------------------------------------------------


def fit_args(base: str, run: Path, record: Path, *extra: str, workers: int = 1) -> list[str]:
    """The quickstart MPP recipe on the digits over HTTP, 4 steps, validation on 2 batches."""
    return [
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        "--data.init_args.train_urls", f"{base}/train-{{000000..000004}}.tar",
        "--data.init_args.val_urls", f"{base}/val-{{000000..000003}}.tar",
        "--data.init_args.num_workers", str(workers), "--data.init_args.batch_size", "32",
        "--data.init_args.train_batches", "4", "--data.init_args.stream.segment_shards", "2",
        *(f"--data.init_args.limits.{key}={value}" for key, value in FAST.items()),
        "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "2",
        "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "pytorch_lightning.loggers.CSVLogger",
        "--trainer.logger.init_args.save_dir", str(run),
        "--trainer.enable_progress_bar", "false", "--model.init_args.picture_every_n_steps", "0",
        "--trainer.callbacks+=resume_helpers.StepRecorder", "--trainer.callbacks.path", str(record),
        "--trainer.default_root_dir", str(run), *extra,
    ]  # fmt: skip


def fit(base: str, run: Path, *extra: str, workers: int = 1, timeout: float = 300):
    record = run.parent / f"{run.name}.jsonl"
    proc = run_cli(*fit_args(base, run, record, *extra, workers=workers), cwd=ROOT, env=ENV, check=False,
                   timeout=timeout)  # fmt: skip
    steps = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc, [(s["step"], s["loss"], s["keys"]) for s in steps]


def checkpoints(run: Path) -> list[str]:
    return (
        sorted(p.name for p in (run / "checkpoints").glob("*.ckpt")) if (run / "checkpoints").exists() else []
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_through_faults_a_retry_mends(faulty_http, digits_shards, tmp_path):
    """A 503 for the manifest, a shard cut half way, a shard that stalls half way and a stalled
    validation shard: every step's loss and batch keys equal a fault-free run's."""
    base = serve(faulty_http, digits_shards)
    proc, clean = fit(base, tmp_path / "clean")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(clean) == 4 and checkpoints(tmp_path / "clean")
    read = {path for method, path, _ in faulty_http.requests if method == "GET" and path.endswith(".tar")}

    faulty_http.reset()
    faulty_http.fail("train.json", "503", 1)
    first, second = sorted(p for p in read if "train-" in p)[:2]
    faulty_http.fail(first, "half", 1)
    faulty_http.fail(second, "stall_body", 1)
    faulty_http.fail("val-000000.tar", "stall", 1)
    proc, faulty = fit(base, tmp_path / "faulty")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert faulty == clean
    assert sorted(fault for _, _, fault in faulty_http.requests if fault) == [
        "503",
        "half",
        "stall",
        "stall_body",
    ]
    assert "skipping bad sample" not in proc.stderr  # mended, not skipped


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_stops_with_one_line_when_the_workers_deliver_nothing(faulty_http, digits_shards, tmp_path):
    """Every training shard stalls after its headers: no batch in loader_timeout_s ends the run with
    one line naming the training shards; no checkpoint is written, and the worker stuck in its read is
    stopped at once (the command ends within the test's timeout)."""
    base = serve(faulty_http, digits_shards)
    faulty_http.fail("train-", "stall_body")
    run = tmp_path / "run"
    proc, steps = fit(base, run, "--data.init_args.limits.read_timeout_s=120",
                      "--data.init_args.limits.loader_timeout_s=3", timeout=60)  # fmt: skip
    one_line_failure(
        proc, "no batch from the 1 DataLoader worker(s) in 3 s while reading train_urls",
        f"{base}/train-000000.tar", "and 2 more",
    )  # fmt: skip
    assert steps == [] and checkpoints(run) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_without_workers_skips_and_counts_shards_that_stall(faulty_http, digits_shards, tmp_path):
    """In the main process (no workers, so no DataLoader timeout) every read times out on its own:
    with every training shard stalled, each is skipped and counted after its tries, and once every
    shard has failed the run stops with one line; no checkpoint is written."""
    base = serve(faulty_http, digits_shards)
    faulty_http.fail("train-", "stall")
    run = tmp_path / "run"
    proc, steps = fit(
        base, run, "--data.init_args.limits.read_timeout_s=1", "--data.init_args.limits.read_retries=0",
        workers=0,
    )  # fmt: skip
    one_line_failure(proc, "no usable sample in a whole pass over 5 shard(s)", "unreadable")
    assert "skipping bad sample" in proc.stderr and "no byte for 1 s" in proc.stderr
    assert steps == [] and checkpoints(run) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_stops_with_one_line_when_a_checkpoint_cannot_be_read(faulty_http, digits_shards, tmp_path):
    """--ckpt_path over HTTP: a server that answers 503 every time ends the run after the checkpoint
    plugin's retries with one line naming the URL; nothing is written."""
    base = serve(faulty_http, digits_shards)
    (faulty_http.root / "last.ckpt").write_bytes(b"never served")
    faulty_http.fail("last.ckpt", "503")
    run = tmp_path / "run"
    plugin = (
        '[{"class_path": "ssl_vit.checkpoints.store.SafeCheckpointIO", "init_args": {"read_retries": 1}}]'
    )
    proc, steps = fit(base, run, "--ckpt_path", f"{base}/last.ckpt", "--trainer.plugins", plugin)
    one_line_failure(proc, f"checkpoint {base}/last.ckpt cannot be read", "HTTP 503", "tried 2 times")
    assert faulty_http.count("last.ckpt") == 2
    assert steps == [] and checkpoints(run) == []
