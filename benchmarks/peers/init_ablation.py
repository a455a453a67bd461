"""Where ssl-vit's MAE and lightly's parted: the encoder's initialisation, one part at a time.

    python benchmarks/peers/init_ablation.py --methods mae --inits timm mae sincos xavier --seeds 0

ssl-vit's own task of the study's recipe (`quality.study_recipe`), trained in the harness every peer is
trained in (`quality.train`: the same stream, optimizer and schedule; with timm's start it computes what
`ssl-vit fit --config recipes/study/METHOD.yaml` computes), its encoder started as:

- `timm`: timm's truncated normals and learned position embeddings (`encoder_init: timm`);
- `mae`: MAE's code, as lightly's masked ViT starts any ViT it wraps (`encoder_init: mae`);
- `sincos`: timm's weights with MAE's fixed sin-cos position embeddings only;
- `xavier`: MAE's weights with timm's learned position embeddings only.

`--target` swaps the preset's target for a peer's (`pixels`: lightly's MAE regresses raw pixels;
`seen_pixels`: the standardised image, as lightly's MAE and stable-pretraining's SimMIM regress it,
the `simmim` preset's own), and `--head` the linear head's start (`head_init`: `xavier`, or `torch` as PyTorch
starts an `nn.Linear`: SimMIM's preset, as SimMIM's code and stable-pretraining's). With the peer's
target, ssl-vit's task computes the peer's loss and gradients from the same weights (equivalence.py).

Then `ssl-vit compare` of them beside each peer's encoders of the same method and seeds where
quality.py has trained them (`--peers-out`), on the study's suite without fine-tuning, into
OUT/compare_METHODS.
`--steps` and `--train-urls` make a smoke run quick.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import quality
from common import sslvit

from ssl_vit.models.init import fixed_sincos_positions, mae_init, mae_weights
from ssl_vit.tasks.masked import HeadInit

INITS = {"timm": None, "mae": mae_init, "sincos": fixed_sincos_positions, "xavier": mae_weights}


def adapter(
    init: str, choices: dict, target: str | None = None, head: str | None = None
) -> types.SimpleNamespace:
    """ssl-vit's task as a harness adapter, with the recipe's `choices` (SimMIM's cell size), its encoder
    started by `INITS[init]` (the task's own `encoder_init` is timm's, so each part is applied alone), and
    `target` and the head's start (`head_init`: xavier, torch) in place of its preset's where given."""
    choices = {**choices, **({"target": target} if target else {}), **({"head_init": head} if head else {})}
    name = "-".join(part for part in ("ssl-vit", init, target, head and f"{head}-head") if part)

    def build(method, settings):
        impl = sslvit(method, settings, encoder_init="timm", **choices)
        if INITS[init] is not None:
            INITS[init](impl.model.backbone)
        return impl

    return types.SimpleNamespace(PEER=name, build=build, timm_encoder=lambda task: task.backbone)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["mae"], choices=["mae", "simmim"])
    parser.add_argument("--inits", nargs="+", default=list(INITS), choices=INITS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument(
        "--target",
        help="in place of the preset's: pixels (MAE on raw pixels in [0, 1]), seen_pixels (the standardised "
        "image, as lightly's MAE and the simmim preset)",
    )
    parser.add_argument(
        "--head",
        choices=HeadInit.__args__,
        help="in place of the preset's: the linear head's start (SimMIM's preset: torch, as its code)",
    )
    parser.add_argument("--steps", type=int, help="default: the study's")
    parser.add_argument("--train-urls", help="default: the study's shards (data.yaml)")
    parser.add_argument("--out", type=Path, default=Path("runs/peers/init"))
    parser.add_argument("--peers-out", type=Path, default=Path("runs/peers/quality"), help="quality.py's")
    parser.add_argument(
        "--suite", type=Path, default=quality.STUDY / "eval.yaml", help="less its fine-tuning"
    )
    parser.add_argument("--no-compare", action="store_true", help="train only")
    parser.add_argument("--ranks", type=int, default=2, help="processes of the comparison (torchrun)")
    args = parser.parse_args(argv)
    groups: dict[str, list[str]] = {}
    for method in args.methods:
        recipe = quality.study_recipe(method)
        for init in args.inits:
            for seed in args.seeds:
                impl = adapter(init, recipe["choices"], args.target, args.head)
                run = impl.PEER.removeprefix("ssl-vit-").replace("-", "_")  # timm_seen_pixels_torch_head
                out = args.out / f"{run}_{method}_{seed}"
                if not (out / "train.json").exists():  # a rerun keeps the runs done
                    quality.train(
                        impl, method, recipe, seed, args.steps or recipe["steps"],
                        args.train_urls or recipe["data"]["train_urls"], out,
                    )  # fmt: skip
                groups.setdefault(f"ssl-vit_{run}_{method}", []).append(str(out / "encoder.safetensors"))
        for peer in ("lightly", "stable-pretraining"):
            trained = [args.peers_out / f"{peer}_{method}_{seed}/encoder.safetensors" for seed in args.seeds]
            if all(path.exists() for path in trained):
                groups[f"{peer}_{method}"] = [str(path) for path in trained]
    if args.no_compare:
        return 0
    suite = quality.quick_suite(args.suite, args.out / "suite.yaml")
    bin_dir = Path(sys.executable).parent  # this environment's torchrun and ssl-vit
    command = [
        str(bin_dir / "torchrun"), "--nproc-per-node", str(args.ranks), "--no-python",
        str(bin_dir / "ssl-vit"), "compare", *(f"{name}={','.join(paths)}" for name, paths in groups.items()),
        "--suite", str(suite),
        "--out", str(args.out / f"compare_{'_'.join(args.methods)}"), "--overwrite",
    ]  # fmt: skip
    print(" ".join(command), flush=True)
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
