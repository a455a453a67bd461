"""`ssl-vit bench step`: images/s of each task's full training step against a plain PyTorch loop over
the same timm model, in the same process, interleaved.

- **plain** (the reference, 1.00): `model(images)` of timm's VisionTransformer with a 1000-class head,
  cross-entropy, `backward`, AdamW `step`, `zero_grad`: the loop a timm user writes.
- Both sides use fused AdamW (one kernel over all parameters; the GPU recipes' optimizer, and on the
  CPU too): torch's default per-parameter loop on the CPU costs about a third of a ViT-B/16 step at
  batch 8, a fixed cost per step that would hide what the tasks themselves cost.
- **tasks**: the Lightning task's own step (`training_step`, its masks and targets, backward, the
  optimizer step and Lightning's automatic optimisation around it), run by `Trainer.fit` on a batch
  already on the device, so neither side pays for data loading.

Rounds alternate plain and every task, each timing `steps` steps after `warmup` untimed ones (the
device synchronised at both ends of the window); the median over rounds is reported. Training FLOPs
per image are counted as `ssl-vit info` counts them (torch's FlopCounterMode, 3 x the forward), and
MFU is against the device's peak: Lightning's table where it knows the device, else a large matmul
measured here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from lightning_fabric.utilities.throughput import get_available_flops
from torch import Tensor

from ssl_vit import memory
from ssl_vit.benchmark import PRECISIONS, TASKS, model_name
from ssl_vit.internals import inductor_cudagraph_skips
from ssl_vit.models.vit import ViTConfig, build_vit, parse_variant
from ssl_vit.quiet import lightning_info_dropped
from ssl_vit.tasks import MaskedPatchPretraining, SupervisedPretraining
from ssl_vit.tasks.base import BackboneTask, Training
from ssl_vit.tasks.compile import CUDA_GRAPH_MODES, compile_blocks, compiled_step

NUM_CLASSES = 1000
DTYPES = {precision: getattr(torch, dtype) for precision, dtype in PRECISIONS.items()}


# The decoders of the recipes where they are not MAE's 8 x 512: I-JEPA's predictor (recipes/ijepa), the
# data2vec 2.0 recipe's (recipes/data2vec2).
DECODERS = {
    "ijepa": dict(decoder_dim=384, decoder_depth=6, decoder_heads=12),
    "data2vec2": dict(decoder_dim=512, decoder_depth=4, decoder_heads=16),
}


def build_task(name: str, config: ViTConfig) -> BackboneTask:
    """The task as a recipe builds it: MAE's 8 x 512 decoder (`DECODERS` for the teacher presets, whose
    EMA teacher runs too), SimMIM's 32-pixel cells (or the nearest that tile the grid, `simmim_cell`),
    fused AdamW. A `config.depth` (`--depth`) is the decoder's depth too."""
    training = Training(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True))
    if name == "supervised":
        return SupervisedPretraining(config, num_classes=NUM_CLASSES, training=training)
    cell = simmim_cell(config) if name == "simmim" else 32
    decoder = DECODERS.get(name, {}) | ({"decoder_depth": config.depth} if config.depth else {})
    return MaskedPatchPretraining(
        config, preset=name, cell_size=cell, picture_every_n_steps=0, training=training, **decoder
    )


def simmim_cell(config: ViTConfig) -> int:
    """SimMIM's 32-pixel mask cells, or the largest cell below them that tiles the patch grid, so that
    every size the other tasks run at runs SimMIM too (28 for H/14's 14-pixel patches, 16 at 48 px)."""
    patch = parse_variant(config.variant).patch_size
    grid = config.img_size // patch
    return patch * max(k for k in range(1, max(1, 32 // patch) + 1) if grid % k == 0)


def task_flops(task: BackboneTask, img_size: int) -> int:
    """Training FLOPs per image of `task` (3 x forward), counted on the meta device as `ssl-vit info`
    counts them; `task` is built under `torch.device("meta")`."""
    task.measure_flops(torch.empty(1, 3, img_size, img_size, device="meta"))
    return task.flops_per_image


@dataclass
class Result:
    name: str
    images_per_s: list[float] = field(default_factory=list)  # one per round
    flops_per_image: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.images_per_s)


class _Window(pl.Callback):
    """Times steps warmup+1 .. warmup+steps of a fit (device synchronised at both ends)."""

    def __init__(self, warmup: int, sync: Callable[[], None]) -> None:
        self.warmup, self.sync = warmup, sync
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup:
            self.sync()
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self.sync()
        self.end = time.perf_counter()


class StepBench:
    """One benchmark configuration; `run()` measures and returns the report as plain values."""

    def __init__(
        self,
        variant: str = "B/16",
        img_size: int = 224,
        batch_size: int = 8,
        tasks: tuple[str, ...] = TASKS,
        precision: str = "32-true",
        compile: bool = False,
        device: str = "cpu",
        rounds: int = 5,
        steps: int = 3,
        warmup: int = 1,
        seed: int = 0,
        compile_scope: str = "blocks",
        compile_mode: str = "default",
        depth: int | None = None,
    ) -> None:
        self.config = ViTConfig(variant, img_size, depth=depth)
        self.batch_size, self.tasks, self.precision = batch_size, tuple(tasks), precision
        self.compile, self.device = compile, torch.device(device)
        self.compile_scope, self.compile_mode = compile_scope, compile_mode
        self.rounds, self.steps, self.warmup, self.seed = rounds, steps, warmup, seed
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    # --- the two sides ---------------------------------------------------------------------------------

    def batch(self) -> dict[str, Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        size = self.config.img_size
        images = torch.randn(self.batch_size, 3, size, size, generator=generator)
        labels = torch.randint(0, NUM_CLASSES, (self.batch_size,), generator=generator)
        return {"image": images.to(self.device), "label": labels.to(self.device)}

    def compiled(self, module: torch.nn.Module, train_loss: Callable) -> Callable:
        """What `--compile` does, alike on both sides: `module`'s transformer blocks compiled in place,
        or its `train_loss` compiled whole (and returned)."""
        if self.compile and self.compile_scope == "blocks":
            compile_blocks(module, self.compile_mode)
        elif self.compile:
            return compiled_step(train_loss, self.compile_mode)
        return train_loss

    def plain_model(self) -> torch.nn.Module:
        return build_vit(
            self.config.variant, self.config.img_size, depth=self.config.depth, num_classes=NUM_CLASSES
        )

    def plain_loop(self) -> Callable[[dict], float]:
        """A timm model, its optimizer and a function that runs `warmup + steps` steps and returns the
        seconds of the timed ones."""
        model = self.plain_model().to(self.device)
        if self.world_size > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def train_loss(images: Tensor, labels: Tensor) -> Tensor:
            return F.cross_entropy(model(images), labels)

        train_loss = self.compiled(model, train_loss)

        def run(batch: dict) -> float:
            for step in range(self.warmup + self.steps):
                if step == self.warmup:
                    self.sync()
                    start = time.perf_counter()
                with self.autocast():
                    loss = train_loss(batch["image"], batch["label"])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            self.sync()
            return time.perf_counter() - start

        return run

    def task_loop(self, name: str) -> tuple[BackboneTask, Callable[[dict], float]]:
        torch.manual_seed(self.seed)
        task = build_task(name, self.config)
        task.train_loss = self.compiled(task, task.train_loss)

        def run(batch: dict) -> float:
            window = _Window(self.warmup, self.sync)
            trainer = pl.Trainer(
                accelerator=self.device.type,
                devices=self.world_size if self.world_size > 1 else 1,
                strategy="ddp" if self.world_size > 1 else "auto",
                precision=self.precision,
                max_steps=self.warmup + self.steps,
                callbacks=[window],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
            )
            loader = torch.utils.data.DataLoader([batch] * (self.warmup + self.steps), batch_size=None)
            with lightning_info_dropped("`Trainer.fit` stopped"):  # a timed round, not the command's end
                trainer.fit(task, train_dataloaders=loader)
            return window.end - window.start

        return task, run

    def autocast(self) -> torch.autocast:
        """Lightning's autocast for the precision (cache_enabled=False, as its precision plugin): with the
        tasks' global state, compiled blocks keep one graph for both sides instead of recompiling at
        every switch."""
        dtype = DTYPES[self.precision]
        return torch.autocast(
            self.device.type, dtype=dtype, enabled=dtype != torch.float32, cache_enabled=False
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- measuring -------------------------------------------------------------------------------------

    def run(self, progress: Callable[[str], None] = lambda _: None) -> dict:
        batch = self.batch()
        loops = {"plain": self.plain_loop()}
        results = {"plain": Result("plain")}
        for name in self.tasks:
            task, loops[name] = self.task_loop(name)
            results[name] = Result(name)
            with torch.device("meta"):
                meta_task = build_task(name, self.config)
            results[name].flops_per_image = task_flops(meta_task, self.config.img_size)
        for round_ in range(self.rounds):
            for name, loop in loops.items():
                seconds = loop(batch)
                rate = self.batch_size * self.steps * self.world_size / seconds
                results[name].images_per_s.append(rate)
                progress(f"round {round_ + 1}/{self.rounds} {name}: {rate:.1f} img/s")
        with torch.device("meta"):
            plain = self.plain_model()
        results["plain"].flops_per_image = 3 * _forward_flops(plain, self.config.img_size)
        return self.report(results)

    def cudagraph_skips(self) -> int | None:
        """Under a CUDA-graph mode, how many compiled graphs inductor ran without them (each says why
        in a `skipping cudagraphs due to ...` warning): 0 on a GPU when the whole step is replayed."""
        if not (self.compile and self.compile_mode in CUDA_GRAPH_MODES):
            return None
        return inductor_cudagraph_skips()

    def report(self, results: dict[str, Result]) -> dict:
        peak_table = get_available_flops(self.device, DTYPES[self.precision])
        peak_measured = measure_peak_flops(self.device, DTYPES[self.precision])
        peak = peak_table or peak_measured
        rows = []
        for name, result in results.items():
            row = {
                "name": name,
                "images_per_s": result.median,
                "rounds": result.images_per_s,
                "vs_plain": paired_ratio(result.images_per_s, results["plain"].images_per_s),
                "gflops_per_image": result.flops_per_image / 1e9,
                "mfu": result.median * result.flops_per_image / (peak * self.world_size),
            }
            supervised = results.get("supervised")
            if supervised is not None and name not in ("plain", "supervised"):
                speedup = paired_ratio(result.images_per_s, supervised.images_per_s)
                flop_ratio = supervised.flops_per_image / result.flops_per_image
                row.update(vs_supervised=speedup, flop_ratio=flop_ratio, of_flop_ratio=speedup / flop_ratio)
            rows.append(row)
        return {
            "config": {
                **asdict(self.config),
                "batch_size": self.batch_size,
                "precision": self.precision,
                "compile": self.compile,
                "compile_scope": self.compile_scope if self.compile else None,
                "compile_mode": self.compile_mode if self.compile else None,
                "cudagraph_skips": self.cudagraph_skips(),
                "device": str(self.device),
                "device_name": _device_name(self.device),
                "world_size": self.world_size,
                "threads": torch.get_num_threads(),
                "rounds": self.rounds,
                "steps": self.steps,
                "warmup": self.warmup,
                "fused_attention": all(_fused_attention(self.config)),
                "torch": torch.__version__,
            },
            "peak_flops": {"lightning_table": peak_table, "measured_matmul": peak_measured, "used": peak},
            "rows": rows,
        }


def batch_memory(variant: str, img_size: int, batch_size: int, depth: int | None = None) -> int:
    """About the fewest bytes a training step of `batch_size` images needs besides the model: the
    float32 images, and per image and block (the variant's, or `depth`) what backward keeps of its
    activations, about 8 tensors of (N, D) and 2 of (N, mlp_dim) floats (the norms' and attention's
    inputs and outputs, q, k and v, the MLP's hidden layer before and after GELU)."""
    parsed = parse_variant(variant)
    width, blocks, _, mlp_dim = parsed.dims
    depth = depth or blocks
    tokens = (img_size // parsed.patch_size) ** 2 + 1
    return batch_size * 4 * (3 * img_size**2 + depth * tokens * (8 * width + 2 * mlp_dim))


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device`: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return memory.host_available()


def _cudagraph_skips_note(config: dict) -> str:
    skips = config.get("cudagraph_skips")
    return f", {skips} compiled graphs ran without CUDA graphs" if skips else ""


def paired_ratio(values: list[float], reference: list[float]) -> float:
    """Median over rounds of the ratio within each round: both were measured moments apart, so a
    slow spell of a shared machine that spans a round cancels out of its ratio."""
    return statistics.median(a / b for a, b in zip(values, reference, strict=True))


def _forward_flops(model: torch.nn.Module, img_size: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, 3, img_size, img_size, device="meta"))
    return counter.get_total_flops()


def _fused_attention(config: ViTConfig) -> list[bool]:
    """timm's Attention uses F.scaled_dot_product_attention (flash / memory-efficient kernels on GPU)
    when `fused_attn` is set; the environment variable TIMM_FUSED_ATTN=0 turns it off."""
    with torch.device("meta"):
        return [block.attn.fused_attn for block in config.build().blocks]


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in `dtype` on `device`: what the hardware delivers to the
    densest kernel the model uses, the denominator when Lightning's table does not know the device."""
    size = 8192 if device.type == "cuda" else 2048
    dtype = dtype if device.type == "cuda" or dtype == torch.float32 else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    repeats = 20 if device.type == "cuda" else 3
    best = float("inf")
    for _ in range(3):  # the best of three: a peak, not an average over a busy machine's spells
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * repeats / best


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


def _compiled(config: dict) -> str:
    if not config["compile"]:
        return "off"
    mode = "" if config["compile_mode"] == "default" else f", {config['compile_mode']}"
    return f"on ({config['compile_scope']}{mode})"


def format_table(report: dict) -> str:
    """The report as a Markdown table (also what `ssl-vit bench step` prints)."""
    c = report["config"]
    head = (
        f"{model_name(c)} at {c['img_size']} px, batch {c['batch_size']} per process x {c['world_size']}, "
        f"{c['precision']}, compile {_compiled(c)}, {c['device']} ({c['device_name']}), "
        f"{c['threads']} threads, median of {c['rounds']} rounds x {c['steps']} steps"
        f"{_cudagraph_skips_note(c)}"
    )
    lines = [
        head,
        "",
        "| step | img/s | vs plain timm | GFLOPs/img (train) | MFU | vs supervised | FLOP ratio "
        "| of FLOP ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        cells = [row["name"], f"{row['images_per_s']:.1f}", f"{row['vs_plain']:.2f}"]
        cells += [f"{row['gflops_per_image']:.1f}", f"{row['mfu']:.1%}"]
        if "vs_supervised" in row:
            cells += [f"{row['vs_supervised']:.2f}x", f"{row['flop_ratio']:.2f}x"]
            cells += [f"**{row['of_flop_ratio']:.2f}**"]
        else:
            cells += ["", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    peak = report["peak_flops"]
    source = "Lightning's table" if peak["lightning_table"] else "measured matmul"
    lines += ["", f"MFU against {peak['used'] / 1e12:.2f} TFLOP/s ({source}); fused SDPA attention: "
              f"{'on' if c['fused_attention'] else 'OFF'}"]  # fmt: skip
    return "\n".join(lines)
