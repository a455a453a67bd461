"""Each peer's MAE and SimMIM trained at the study's budget on the study's stream, their encoders
exported, and all of them evaluated beside ssl-vit's own runs of the same recipes (`make study`) with
`ssl-vit compare`, its verdicts read on benchmarks/peers/claims.yaml (those of the rows compared).

    python benchmarks/peers/quality.py --methods mae simmim --seeds 0 1 --out runs/peers/quality

Everything a study recipe sets is read from it (recipes/study/METHOD.yaml, data.yaml, trainer.yaml):
the ViT (S/4, 96 wide, 6 deep, 3 heads, 28 px), MAE's decoder (64 wide, 2 blocks, 4 heads), the mask
ratio (MAE 0.75, SimMIM 0.6), AdamW with weight decay off for norms, biases, position embeddings and
tokens (ssl-vit's groups), its warmup-cosine schedule, the steps and the batch; every implementation
reads the same `ShardDataModule` stream (its seed the run's). What a peer has no option for is said in
its adapter (lightly's MAE regresses raw pixels, not per-patch normalised ones).

Each run writes OUT/PEER_METHOD_SEED/encoder.safetensors (timm's names, ssl-vit's backbone config in the
metadata) and its loss every 50 steps. Then `ssl-vit compare` runs on the study's suite without its
fine-tune protocol (the slowest; OUT/suite.yaml), ssl-vit's rows from `--study` (run by `make study`
first), into OUT/compare (or `--compare-out`), and its results and verdicts are appended to
`--results`. `--steps`, `--train-urls`, `--suite` and `--no-compare` make a smoke run quick; a run of
some `--peers` or seeds reuses the runs OUT holds; `--peer-seeds` gives the peers more runs than
ssl-vit's (the paired interval resamples each row's runs on their own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
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
from ssl_vit.report.verdicts import listed
from ssl_vit.tasks import WarmupDecay
from ssl_vit.tasks.optim import weight_decay_groups

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "recipes/study"


CLAIMS = Path(__file__).with_name("claims.yaml")
# What ssl-vit's tasks leave out of weight decay beside the 1-D parameters, wherever a peer keeps them
NO_DECAY = {"*pos_embed", "*cls_token", "*mask_token"}


def study_recipe(method: str) -> dict:
    """The settings of the study's recipe of `method`, from its recipe files."""
    model = yaml.safe_load((STUDY / f"{method}.yaml").read_text())["model"]["init_args"]
    data = yaml.safe_load((STUDY / "data.yaml").read_text())["init_args"]
    trainer = yaml.safe_load((STUDY / "trainer.yaml").read_text())
    backbone = model["backbone"]
    settings = Settings(
        backbone["variant"], data["image_size"], width=backbone.get("width"), depth=backbone.get("depth"),
        heads=backbone.get("heads"),
        **{key: model[key] for key in ("decoder_dim", "decoder_depth", "decoder_heads") if key in model},
    )  # fmt: skip
    return dict(
        settings=settings,
        choices={key: model[key] for key in ("cell_size",) if key in model},  # the task's own, for ssl-vit
        optimizer=model["training"]["optimizer"]["init_args"],
        schedule=model["training"]["lr_scheduler"]["init_args"],
        data=data,
        steps=trainer["max_steps"],
    )


def epochs(module: ShardDataModule):
    """The training stream's batches, epoch after epoch (each pass of the loader is the next epoch), as
    a fit of `max_steps` reads them."""
    while True:
        yield from module.train_dataloader()


def train(adapter, method: str, recipe: dict, seed: int, steps: int, train_urls: str, out: Path) -> dict:
    torch.manual_seed(seed)
    impl = adapter.build(method, recipe["settings"])
    opt = recipe["optimizer"]
    optimizer = torch.optim.AdamW(
        weight_decay_groups(impl.model, NO_DECAY), lr=opt["lr"], betas=tuple(opt["betas"]),
        weight_decay=opt["weight_decay"],
    )  # fmt: skip
    schedule = WarmupDecay(optimizer, total_steps=steps, **recipe["schedule"])
    data = recipe["data"]
    module = ShardDataModule(
        train_urls=train_urls, image_size=data["image_size"], batch_size=data["batch_size"],
        num_workers=data["num_workers"], seed=seed, augment=Augment(**data.get("augment", {})),
    )  # fmt: skip
    module.setup("fit")
    losses, start = {}, time.perf_counter()
    for step, batch in zip(range(steps), epochs(module), strict=False):
        loss = one_step(impl, optimizer, module.prepare_batch(batch)["image"])  # as the tasks see it
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            losses[step] = float(loss)
            print(f"{adapter.PEER} {method} seed {seed} step {step}: loss {losses[step]:.4f}", flush=True)
    if step != steps - 1:
        raise RuntimeError(f"{adapter.PEER} {method}: the stream ended after {step + 1} of {steps} steps")
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in adapter.timm_encoder(impl.model).state_dict().items()}
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    save_file(state, out / "encoder.safetensors", metadata=config_metadata(recipe["settings"].config()))
    record = dict(
        peer=adapter.PEER, method=method, seed=seed, steps=steps, seconds=time.perf_counter() - start,
        loss=losses,
    )  # fmt: skip
    (out / "train.json").write_text(json.dumps(record, indent=1))
    return record


def quick_suite(suite: Path, out: Path) -> Path:
    """`suite` without its fine-tune protocols, written to `out`."""
    loaded = yaml.safe_load(suite.read_text())
    loaded["protocols"] = [p for p in loaded["protocols"] if p.get("kind") != "finetune"]
    out.write_text(yaml.safe_dump(loaded, sort_keys=False))
    return out


def claims_of(groups: dict[str, list[str]], out: Path) -> Path | None:
    """claims.yaml less the rows not compared (a run of some peers or methods only), written to `out`;
    None when no claim keeps a row on each side."""
    loaded = yaml.safe_load(CLAIMS.read_text())
    kept = []
    for claim in loaded["claims"]:
        rows, against = ([n for n in listed(claim[key]) if n in groups] for key in ("rows", "against"))
        if rows and against:
            kept.append({**claim, "rows": rows, "against": against})
    if not kept:
        return None
    out.write_text(yaml.safe_dump({**loaded, "claims": kept}, sort_keys=False))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["mae", "simmim"], choices=["mae", "simmim"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--peer-seeds", nargs="+", type=int, help="the peers' seeds (default: --seeds)")
    parser.add_argument("--steps", type=int, help="default: the study's (trainer.yaml max_steps)")
    parser.add_argument("--train-urls", help="default: the study's shards (data.yaml)")
    parser.add_argument("--peers", nargs="+", default=list(ADAPTERS), choices=ADAPTERS)
    parser.add_argument("--out", type=Path, default=Path("runs/peers/quality"))
    parser.add_argument("--study", type=Path, default=Path("runs/study"), help="make study's runs")
    parser.add_argument("--suite", type=Path, default=STUDY / "eval.yaml", help="less its fine-tuning")
    parser.add_argument("--results", type=Path, help="append the comparison to this page (RESULTS.md)")
    parser.add_argument("--no-compare", action="store_true", help="train and export only")
    parser.add_argument("--compare-out", type=Path, help="where the comparison goes (default: OUT/compare)")
    parser.add_argument("--ranks", type=int, default=2, help="processes of the comparison (torchrun)")
    args = parser.parse_args(argv)
    for option in ("methods", "seeds", "peer_seeds", "peers"):
        given = getattr(args, option) or []
        if len(set(given)) != len(given):  # a run given twice would count as two runs in the intervals
            parser.error(f"--{option.replace('_', '-')} {' '.join(map(str, given))}: give each once")
    groups: dict[str, list[str]] = {}
    for method in args.methods:
        recipe = study_recipe(method)
        print(f"{method} settings: {asdict(recipe['settings'])}", flush=True)
        steps, urls = args.steps or recipe["steps"], args.train_urls or recipe["data"]["train_urls"]
        ours = [args.study / f"{method}_{seed}/checkpoints/last.ckpt" for seed in args.seeds]
        groups[method] = [str(path) for path in ours]
        for module in args.peers:
            adapter = __import__(module)
            for seed in args.peer_seeds or args.seeds:
                out = args.out / f"{adapter.PEER}_{method}_{seed}"
                if not (out / "train.json").exists():  # a rerun keeps the runs done
                    train(adapter, method, recipe, seed, steps, urls, out)
                groups.setdefault(f"{adapter.PEER}_{method}", []).append(str(out / "encoder.safetensors"))
    missing = [path for paths in groups.values() for path in paths if not Path(path).exists()]
    if args.no_compare or missing:
        if missing:
            print(f"not compared: {', '.join(missing)} missing (make study writes ssl-vit's)", flush=True)
        return 1 if missing and not args.no_compare else 0
    suite = quick_suite(args.suite, args.out / "suite.yaml")
    compare = args.compare_out or args.out / "compare"
    claims = claims_of(groups, args.out / "claims.yaml")
    command = [
        "ssl-vit", "compare", *(f"{name}={','.join(paths)}" for name, paths in groups.items()),
        "--suite", str(suite), *(["--claims", str(claims)] if claims else []), "--out", str(compare),
        "--overwrite",
    ]  # fmt: skip
    print(" ".join(command), flush=True)
    bin_dir = Path(sys.executable).parent  # this environment's torchrun and ssl-vit
    torchrun = [str(bin_dir / "torchrun"), "--nproc-per-node", str(args.ranks), "--no-python"]
    subprocess.run([*torchrun, str(bin_dir / "ssl-vit"), *command[1:]], check=True)
    if args.results:
        seeds = f"{args.seeds}" + (f" (the peers' {args.peer_seeds})" if args.peer_seeds else "")
        verdicts = compare / "verdicts.md"  # none without claims
        with args.results.open("a") as page:
            page.write(
                f"""
## Quality at the study's budget

Written by benchmarks/peers/quality.py (`make peers` runs it after `make study`); measured, not edited
by hand. Each implementation trained {steps} steps of {recipe["data"]["batch_size"]} Fashion-MNIST images from
the seeds {seeds}, on one `ShardDataModule` stream, then `{" ".join(command)}`. Every value
is the mean over the seeds with its 95% interval (seeds, few-shot draws and test images resampled);
a verdict reads the paired interval of ssl-vit's row against each peer's. No fine-tune columns.

{(compare / "results.md").read_text()}
{verdicts.read_text() if verdicts.exists() else ""}
"""
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
