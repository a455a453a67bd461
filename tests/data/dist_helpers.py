"""Code that runs inside the 2-rank tests' processes (importable: `cli_helpers.start_ranks` starts them)."""

import json
from pathlib import Path

import torch.distributed as dist


def exact_and_training_pass(rank: int, world_size: int, port: int, urls: str, out: str) -> None:
    """One rank: an exact pass and a training epoch over `urls`, 2 workers each; results to out/rankN.json.

    No RANK/WORLD_SIZE in the environment, only the process group: a pipeline that let its workers
    discover the rank would see rank 0 in every worker and duplicate the data.
    """
    import multiprocessing

    from ssl_vit.data import ShardDataModule
    from ssl_vit.data.options import Augment, Stream

    # A rank started by `cli_helpers.start_ranks` inherits the "forkserver" start method; torchrun- and
    # Lightning-launched ranks fork their DataLoader workers, as here.
    multiprocessing.set_start_method("fork", force=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dm = ShardDataModule(
        train_urls=urls,
        val_urls=urls,
        batch_size=2,
        num_workers=2,
        image_size=16,
        augment=Augment(eval_crop_pct=1.0),
        train_batches=5,
        stream=Stream(shuffle_buffer=8),
        seed=3,
    )
    dm.setup("fit")
    keys = [k for batch in dm.val_dataloader() for k in batch["key"]]
    train = [batch["key"] for batch in dm.train_dataloader()]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"exact": keys, "train": train}))
    dist.barrier()
    dist.destroy_process_group()
