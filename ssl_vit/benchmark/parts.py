"""`ssl-vit bench parts`: where a masked task's step time goes, against supervised's, piece by piece.

A masked task's speed-up over supervised falls short of its FLOP ratio when some of its FLOPs run
slower than supervised's do. Each piece is timed alone, forward and backward (no optimizer), in the
same process as supervised's, interleaved over rounds, and its FLOP rate is given as a fraction of
supervised's transformer blocks' in the same round (the median of those paired ratios):

- **blocks**: the backbone's transformer blocks, on an input of the shape and dtype the task's own step
  feeds them (recorded with a hook on one real step: 1 + 49 tokens for MAE at B/16, 224 px);
- **decoder blocks**: MAE's 8 x 512 decoder blocks, likewise;
- **step**: the task's whole `train_loss` and its backward, as the training step runs it (eager);
- **rest**: the step minus its blocks, round by round: patch embedding, masking, gathers, targets,
  the loss, heads. It has no FLOP rate of its own worth reading: a few FLOPs over a difference of times.

FLOPs are counted by torch's FlopCounterMode on that forward and backward, with attention through
the math backend: torch counts no FLOPs for the CPU's fused attention kernel, and the math backend's
matrix products are counted on every device. No time of this file is ever a test's threshold.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.benchmark import model_name
from ssl_vit.benchmark.step import StepBench, build_task, paired_ratio
from ssl_vit.tasks.base import BackboneTask, step_inputs, step_loss


@dataclass
class Piece:
    task: str
    name: str
    run: Callable[[], None]  # one forward and backward
    shape: tuple[int, ...] = ()  # a block stack's input shape (B, tokens, width)
    flops: int = 0
    seconds: list[float] = field(default_factory=list)  # per step, one per round


class PartsBench:
    """One configuration; `run()` measures and returns the report as plain values."""

    def __init__(self, bench: StepBench, task: str = "mae") -> None:
        """`bench` holds the model, batch, precision, device and rounds; `task` is the masked task."""
        self.bench, self.task_name = bench, task

    def pieces(self, name: str) -> list[Piece]:
        """The pieces of task `name`'s step: its block stacks on the inputs its step feeds them, then
        the whole step."""
        bench = self.bench
        torch.manual_seed(bench.seed)
        task = build_task(name, bench.config).to(bench.device).train()
        inputs = step_inputs(bench.batch())
        stacks = {"blocks": task.backbone.blocks}
        if hasattr(task, "decoder"):
            stacks["decoder blocks"] = task.decoder.blocks
        pieces = [
            self._stack_piece(name, task, label, stacks[label], x)
            for label, x in self._stack_inputs(task, stacks, inputs).items()
        ]

        def step() -> None:
            with bench.autocast():
                out = task.train_loss(inputs)
            step_loss(out).backward()
            task.zero_grad(set_to_none=True)

        return pieces + [Piece(name, "step", step)]

    def _stack_inputs(self, task: BackboneTask, stacks: dict[str, nn.Module], inputs: dict) -> dict:
        """A random input, requiring grad as a step's does, of the shape and dtype each stack gets in
        one step of `task`."""
        seen: dict[str, list[Tensor]] = {label: [] for label in stacks}

        def record(label: str, module: nn.Module, args: tuple) -> None:
            seen[label].append(args[0])

        hooks = [stack.register_forward_pre_hook(partial(record, label)) for label, stack in stacks.items()]
        try:
            with torch.no_grad(), self.bench.autocast():
                task.train_loss(inputs)
        finally:
            for hook in hooks:
                hook.remove()
        # Each stack once per step: not at all under activation checkpointing, which runs the blocks
        # one by one; its time would land in the rest.
        if wrong := [f"{label} ran {len(xs)} times" for label, xs in seen.items() if len(xs) != 1]:
            raise RuntimeError(
                f"{type(task).__name__}'s step: {', '.join(wrong)}, not once; cannot time it alone"
            )
        return {
            label: torch.randn(x.shape, dtype=x.dtype, device=x.device, requires_grad=True)
            for label, (x,) in seen.items()
        }

    def _stack_piece(self, name: str, task: BackboneTask, label: str, stack: nn.Module, x: Tensor) -> Piece:
        grad = torch.randn_like(x)  # a residual stack's output has its input's shape and dtype

        def run() -> None:
            with self.bench.autocast():
                out = stack(x)
            out.backward(grad)
            task.zero_grad(set_to_none=True)
            x.grad = None

        return Piece(name, label, run, tuple(x.shape))

    def run(self, progress: Callable[[str], None] = lambda _: None) -> dict:
        pieces = self.pieces("supervised") + self.pieces(self.task_name)
        for piece in pieces:
            with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
                piece.run()
            piece.flops = counter.get_total_flops()
        for index in range(self.bench.rounds):
            for piece in pieces:
                piece.seconds.append(self._time(piece.run))
            progress(f"round {index + 1}/{self.bench.rounds} done")
        return self.report(pieces)

    def _time(self, run: Callable[[], None]) -> float:
        for _ in range(self.bench.warmup):
            run()
        self.bench.sync()
        start = time.perf_counter()
        for _ in range(self.bench.steps):
            run()
        self.bench.sync()
        return (time.perf_counter() - start) / self.bench.steps

    def report(self, pieces: list[Piece]) -> dict:
        reference = pieces[0]  # supervised's blocks
        rows, steps = [], {}
        for task in ("supervised", self.task_name):
            *stacks, step = [piece for piece in pieces if piece.task == task]
            rest = Piece(task, "rest", lambda: None, flops=step.flops - sum(p.flops for p in stacks))
            rest.seconds = [s - sum(times) for s, *times in zip(step.seconds, *(p.seconds for p in stacks))]
            rows += [_row(piece, step, _paired_rate(piece, reference)) for piece in stacks]
            rows += [_row(rest, step, None), _row(step, step, _paired_rate(step, reference))]
            steps[task] = step
        supervised, task = steps["supervised"], steps[self.task_name]
        speedup = paired_ratio(supervised.seconds, task.seconds)
        flop_ratio = supervised.flops / task.flops
        b = self.bench
        config = dict(
            variant=b.config.variant, depth=b.config.depth, img_size=b.config.img_size,
            batch_size=b.batch_size, task=self.task_name, precision=b.precision, device=str(b.device),
            threads=torch.get_num_threads(), rounds=b.rounds, steps=b.steps, warmup=b.warmup,
        )  # fmt: skip
        return dict(
            config=config,
            rows=rows,
            speedup=speedup,
            flop_ratio=flop_ratio,
            of_flop_ratio=speedup / flop_ratio,
        )


def _paired_rate(piece: Piece, reference: Piece) -> float:
    """`piece`'s FLOP rate over `reference`'s, round by round (`paired_ratio`)."""
    return paired_ratio(
        [piece.flops / s for s in piece.seconds], [reference.flops / s for s in reference.seconds]
    )


def _row(piece: Piece, step: Piece, vs_reference: float | None) -> dict:
    """`vs_reference` None: no FLOP rate is given (the rest)."""
    median = statistics.median(piece.seconds)
    share = paired_ratio(piece.seconds, step.seconds)
    return dict(
        task=piece.task, piece=piece.name, tokens=list(piece.shape[1:]), seconds=median,
        gflops=piece.flops / 1e9, tflop_s=None if vs_reference is None else piece.flops / 1e12 / median,
        vs_reference=vs_reference, share=share, rounds=piece.seconds,
    )  # fmt: skip


def format_parts(report: dict) -> str:
    """The report as a Markdown table (what `ssl-vit bench parts` prints)."""
    c = report["config"]
    lines = [
        f"{model_name(c)} at {c['img_size']} px, batch {c['batch_size']}, {c['precision']}, {c['device']}, "
        f"{c['threads']} threads, forward + backward without the optimizer, eager, median of {c['rounds']} "
        f"rounds x {c['steps']} steps",
        "",
        "| task | piece | tokens x width | GFLOP | ms | TFLOP/s | vs supervised blocks | of its step |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        rate = (
            ["", ""]
            if row["vs_reference"] is None
            else [f"{row['tflop_s']:.3f}", f"{row['vs_reference']:.2f}"]
        )
        cells = [row["task"], row["piece"], " x ".join(map(str, row["tokens"])), f"{row['gflops']:.1f}"]
        cells += [f"{row['seconds'] * 1e3:.1f}", *rate, f"{row['share']:.0%}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"{c['task']} against supervised: FLOP ratio {report['flop_ratio']:.2f}x, speed ratio "
        f"{report['speedup']:.2f}x: **{report['of_flop_ratio']:.2f}** of its FLOP ratio",
    ]
    return "\n".join(lines)
