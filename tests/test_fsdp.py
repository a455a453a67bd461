"""FSDP2 (Lightning's ModelParallelStrategy, the strategy of recipes/base/trainer_fsdp32.yaml) on two
CPU processes over gloo: the same steps as DDP, a checkpoint saved in one file that resumes exactly
and loads anywhere a checkpoint is taken."""

import pytest
import torch
import yaml
from cli_helpers import torchrun_fit
from resume_helpers import ROOT, fit_args, read_steps

from ssl_vit.checkpoints import load_backbone


def fit(args, **kwargs) -> None:
    proc = torchrun_fit(args, **kwargs)
    assert proc.returncode == 0, proc.stderr[-3000:]


def strategy_file(tmp_path, **init_args) -> str:
    """The shipped FSDP trainer's strategy, on two CPU processes."""
    shipped = yaml.safe_load((ROOT / "recipes/base/trainer_fsdp32.yaml").read_text())["strategy"]
    shipped["init_args"].update(init_args)
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"strategy": shipped, "devices": 2}}))
    return str(path)


def losses(record) -> dict[tuple[int, int], float]:
    return {(r["rank"], r["step"]): r["loss"] for r in read_steps(record)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_matches_ddp_and_resumes_from_its_checkpoint(digits_shards, tmp_path):
    ddp = tmp_path / "ddp.jsonl"
    fit(fit_args(digits_shards, tmp_path / "ddp", ddp, "--trainer.limit_val_batches", "1", epochs=1))
    # Sharded over both processes (a (1, 2) mesh), stopped after step 4, then resumed from last.ckpt.
    fsdp, run_dir = tmp_path / "fsdp.jsonl", tmp_path / "fsdp"
    strategy = strategy_file(tmp_path, data_parallel_size=1, tensor_parallel_size=2)
    args = fit_args(
        digits_shards, run_dir, fsdp, "--trainer.limit_val_batches", "1", "--config", strategy, epochs=1
    )
    fit([*args, "--trainer.max_steps", "4"], strategy=None)
    saved = torch.load(run_dir / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 4
    fit([*args, "--ckpt_path", "last"], strategy=None)

    reference, sharded = losses(ddp), losses(fsdp)
    assert sorted(sharded) == sorted(reference) == [(r, s) for r in (0, 1) for s in range(1, 7)]
    for key, loss in reference.items():
        assert sharded[key] == pytest.approx(loss, abs=1e-5), key
    assert [r["step"] for r in read_steps(fsdp) if r["rank"] == 0] == [1, 2, 3, 4, 5, 6]  # none twice

    # One file, plain tensors under timm's names: the final weights are DDP's.
    final = torch.load(run_dir / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    ddp_final = torch.load(tmp_path / "ddp/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == ddp_final["global_step"] == 6
    assert final["state_dict"].keys() == ddp_final["state_dict"].keys()
    for name, value in ddp_final["state_dict"].items():
        assert type(final["state_dict"][name]) is torch.Tensor
        torch.testing.assert_close(final["state_dict"][name], value, atol=1e-5, rtol=1e-4, msg=name)
    backbone, config = load_backbone(str(run_dir / "checkpoints/last.ckpt"))
    assert config.width == 64 and len(backbone.blocks) == 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_shards_the_ema_teacher_like_the_student_and_matches_ddp(digits_shards, tmp_path):
    """I-JEPA: the teacher's blocks are FSDP units like the student's (`BackboneTask.configure_model`
    shards every timm Block of the task), updated shard by shard from the student's; the losses and the
    saved teacher are DDP's, whose ranks each update a full replica."""
    ijepa = ["--model.init_args.preset", "ijepa", "--model.init_args.decoder_dim", "64",
             "--model.init_args.decoder_depth", "2", "--model.init_args.decoder_heads", "4",
             "--trainer.limit_val_batches", "0", "--trainer.max_steps", "4"]  # fmt: skip
    ddp = tmp_path / "ddp.jsonl"
    fit(fit_args(digits_shards, tmp_path / "ddp", ddp, *ijepa, epochs=1))
    fsdp = tmp_path / "fsdp.jsonl"
    strategy = strategy_file(tmp_path, data_parallel_size=1, tensor_parallel_size=2)
    fit(
        fit_args(digits_shards, tmp_path / "fsdp", fsdp, *ijepa, "--config", strategy, epochs=1),
        strategy=None,
    )
    reference, sharded = losses(ddp), losses(fsdp)
    assert sorted(sharded) == sorted(reference) == [(r, s) for r in (0, 1) for s in range(1, 5)]
    for key, loss in reference.items():
        assert sharded[key] == pytest.approx(loss, abs=1e-5), key
    final = torch.load(tmp_path / "fsdp/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    ddp_final = torch.load(tmp_path / "ddp/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    teacher = {k: v for k, v in final["state_dict"].items() if k.startswith("teacher.")}
    assert teacher and teacher.keys() == {k for k in ddp_final["state_dict"] if k.startswith("teacher.")}
    for name, value in teacher.items():
        assert type(value) is torch.Tensor
        torch.testing.assert_close(value, ddp_final["state_dict"][name], atol=1e-5, rtol=1e-4)
