"""Code that runs inside the 2-rank feature-extraction test's processes (`cli_helpers.start_ranks`)."""

from pathlib import Path

import torch
import torch.distributed as dist


def extract_on_rank(rank: int, world_size: int, port: int, urls: str, out: str) -> None:
    """One rank: its own exact pass over `urls`, extracted and gathered; results to out/rankN.pt."""
    import multiprocessing

    from ssl_vit.data import ShardDataModule
    from ssl_vit.evaluation.features import extract_features
    from ssl_vit.models.vit import build_vit

    # the rank's start method ("forkserver") is inherited by DataLoader workers; launched ranks fork
    multiprocessing.set_start_method("fork", force=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # the same weights on every rank, as DDP guarantees
    backbone = build_vit("S/8", 32, width=32, depth=1, heads=2)
    dm = ShardDataModule(val_urls=urls, image_size=32, batch_size=16, num_workers=1)
    local_keys = []

    def recording(loader):
        for batch in loader:
            local_keys.extend(batch["key"])
            yield batch

    features = extract_features(backbone, recording(dm.exact_dataloader("val")), prepare=dm.prepare_batch)
    torch.save({"features": tuple(features), "local_keys": local_keys}, Path(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
