"""The pretraining cost a task records in its checkpoints, and what `compare` reads back."""

import torch
from task_helpers import DigitBatches, trainer

from ssl_vit.evaluation.suite import pretraining_cost
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import SupervisedPretraining
from ssl_vit.tasks.base import COST_KEY

BACKBONE = ViTConfig("S/8", 32, width=32, depth=2, heads=2)
BATCH = 8


def test_a_checkpoint_counts_steps_images_flops_and_time_and_a_resume_keeps_counting(tmp_path, digits_batch):
    torch.manual_seed(0)
    model = SupervisedPretraining(BACKBONE, num_classes=10)
    run = trainer(tmp_path, max_steps=3, limit_val_batches=0)
    run.fit(model, datamodule=DigitBatches(digits_batch, batch_size=BATCH, steps=3))
    run.save_checkpoint(tmp_path / "three.ckpt")
    cost = pretraining_cost(str(tmp_path / "three.ckpt"))
    flops = model.flops_per_image
    assert flops and flops > 0
    assert (cost["steps"], cost["images"], cost["flops"]) == (3, 3 * BATCH, 3 * BATCH * flops)
    assert cost["seconds"] > 0

    resumed = SupervisedPretraining(BACKBONE, num_classes=10)
    run = trainer(tmp_path, max_steps=5, limit_val_batches=0)
    run.fit(
        resumed,
        datamodule=DigitBatches(digits_batch, batch_size=BATCH, steps=5),
        ckpt_path=tmp_path / "three.ckpt",
    )
    run.save_checkpoint(tmp_path / "five.ckpt")
    again = pretraining_cost(str(tmp_path / "five.ckpt"))
    assert (again["steps"], again["images"], again["flops"]) == (5, 5 * BATCH, 5 * BATCH * flops)
    assert again["seconds"] > cost["seconds"]


def test_checkpoints_without_the_count_have_no_cost(tmp_path):
    old = tmp_path / "old.ckpt"
    torch.save({"state_dict": {}, "global_step": 7}, old)
    assert pretraining_cost(str(old)) is None
    torch.save({"state_dict": {}, COST_KEY: {"steps": 1, "images": 2, "flops": 3, "seconds": 4.0}}, old)
    assert pretraining_cost(str(old)) == {"steps": 1, "images": 2, "flops": 3, "seconds": 4.0}
    assert pretraining_cost("timm:vit_tiny_patch16_224") is None
    assert pretraining_cost("scratch") == {"steps": 0, "images": 0, "flops": 0, "seconds": 0.0}
