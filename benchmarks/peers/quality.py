"""Each peer's MAE trained at the study's budget on the study's stream, its encoder exported for
`ssl-vit compare` beside ssl-vit's own MAE runs (`make study`).

    python benchmarks/peers/quality.py --seeds 0 1 --out runs/peers/quality   # 1,200 steps of 64 each

Everything the study's MAE recipe sets is read from it (recipes/study/mae.yaml, data.yaml,
trainer.yaml): the ViT (S/4, 96 wide, 6 deep, 3 heads, 28 px), the decoder (64 wide, 2 blocks, 4
heads), the mask ratio (0.75), AdamW and its warmup-cosine schedule, the steps and the batch; every
implementation reads the same `ShardDataModule` stream (its seed the run's). What a peer has no option
for is said in its adapter (lightly's MAE regresses raw pixels, not per-patch normalised ones).

Each run writes OUT/PEER_SEED/encoder.safetensors (timm's names, ssl-vit's backbone config in the
metadata) and its loss every 50 steps; the last line printed is the `ssl-vit compare` command over
them and the study's own MAE checkpoints. `--steps` and `--train-urls` make a smoke run quick.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import yaml
from common import Settings, one_step
from safetensors.torch import save_file
from speed import ADAPTERS

from ssl_vit.checkpoints import config_metadata
from ssl_vit.data import ShardDataModule
from ssl_vit.data.options import Augment
from ssl_vit.tasks import WarmupDecay

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "recipes/study"


def study_recipe() -> dict:
    """The study MAE's settings, from its recipe files."""
    model = yaml.safe_load((STUDY / "mae.yaml").read_text())["model"]["init_args"]
    data = yaml.safe_load((STUDY / "data.yaml").read_text())["init_args"]
    trainer = yaml.safe_load((STUDY / "trainer.yaml").read_text())
    backbone = model["backbone"]
    settings = Settings(
        backbone["variant"], data["image_size"], model["decoder_dim"], model["decoder_depth"],
        model["decoder_heads"], width=backbone.get("width"), depth=backbone.get("depth"),
        heads=backbone.get("heads"),
    )  # fmt: skip
    return dict(
        settings=settings,
        optimizer=model["optimizer"]["init_args"],
        schedule=model["lr_scheduler"]["init_args"],
        data=data,
        steps=trainer["max_steps"],
    )


def train(adapter, recipe: dict, seed: int, steps: int, train_urls: str, out: Path) -> dict:
    torch.manual_seed(seed)
    impl = adapter.build("mae", recipe["settings"])
    params = [p for p in impl.model.parameters() if p.requires_grad]
    opt = recipe["optimizer"]
    optimizer = torch.optim.AdamW(
        params, lr=opt["lr"], betas=tuple(opt["betas"]), weight_decay=opt["weight_decay"]
    )
    schedule = WarmupDecay(optimizer, total_steps=steps, **recipe["schedule"])
    data = recipe["data"]
    module = ShardDataModule(
        train_urls=train_urls, image_size=data["image_size"], batch_size=data["batch_size"],
        num_workers=data["num_workers"], seed=seed, augment=Augment(**data.get("augment", {})),
    )  # fmt: skip
    module.setup("fit")
    losses, start = {}, time.perf_counter()
    for step, batch in enumerate(module.train_dataloader()):
        if step == steps:
            break
        loss = one_step(impl, optimizer, module.prepare_batch(batch)["image"])  # as the tasks see it
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            losses[step] = float(loss)
            print(f"{adapter.PEER} seed {seed} step {step}: loss {losses[step]:.4f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in adapter.timm_encoder(impl.model).state_dict().items()}
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    save_file(state, out / "encoder.safetensors", metadata=config_metadata(recipe["settings"].config()))
    record = dict(peer=adapter.PEER, seed=seed, steps=steps, seconds=time.perf_counter() - start, loss=losses)
    (out / "train.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, help="default: the study's (trainer.yaml max_steps)")
    parser.add_argument("--train-urls", help="default: the study's shards (data.yaml)")
    parser.add_argument("--peers", nargs="+", default=list(ADAPTERS), choices=ADAPTERS)
    parser.add_argument("--out", type=Path, default=Path("runs/peers/quality"))
    parser.add_argument("--study", type=Path, default=Path("runs/study"), help="make study's runs")
    args = parser.parse_args(argv)
    recipe = study_recipe()
    print(f"settings: {asdict(recipe['settings'])}", flush=True)
    groups = {}
    steps, urls = args.steps or recipe["steps"], args.train_urls or recipe["data"]["train_urls"]
    for module in args.peers:
        adapter = __import__(module)
        for seed in args.seeds:
            out = args.out / f"{adapter.PEER}_{seed}"
            train(adapter, recipe, seed, steps, urls, out)
            groups.setdefault(adapter.PEER, []).append(str(out / "encoder.safetensors"))
    ours = [str(args.study / f"mae_{seed}/checkpoints/last.ckpt") for seed in args.seeds]
    groups = {"ssl-vit": ours, **groups}
    names = " ".join(f"{name}={','.join(paths)}" for name, paths in groups.items())
    print(
        f"ssl-vit compare {names} --baseline ssl-vit --suite {STUDY.relative_to(ROOT)}/eval.yaml "
        f"--out {args.out}/compare"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
