"""One training step of every method ssl-vit and a peer both implement, side by side in one process.

    python benchmarks/peers/speed.py --variants S/16 B/16 --batch-size 8 --rounds 5 \
        --results benchmarks/peers/RESULTS.md

The step is forward, loss, backward, AdamW (fused, MAE's betas and weight decay) and zero_grad, the same
loop around every implementation (`common.one_step`); each side is its own model on the same timm
ViT, with the same decoder (or predictor) size and mask ratio where it has the option (`Settings`).
One untimed step each, then rounds: every round times one step of each implementation, in an order
rotated every round, so that a slow moment of the machine falls on all of them alike; the median
over rounds is reported with its spread (the fastest and slowest round). The untimed step counts the
work too (GFLOP of its forward and backward, torch's `FlopCounterMode`): where two implementations of
one method differ in it, they compute different things (masks of random size move it from step to
step). Parameters are the trained ones (a teacher's EMA copy excluded); peak memory is the resident
memory one step adds over the process that holds no model, measured in a forked child per
implementation before any timing (`/proc/self/status` VmHWM, reset by `/proc/self/clear_refs`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from common import Impl, Settings, one_step, sslvit, trainable
from torch.utils.flop_counter import FlopCounterMode

ADAPTERS = ("adapter_lightly", "adapter_stable_pretraining")
METHODS = ("mae", "simmim", "maskfeat", "ijepa")


def implementations(method: str, settings: Settings, peers: dict) -> dict:
    """name -> a function building that implementation: ssl-vit's, then each peer's that has the method."""
    builders = {"ssl-vit": lambda: sslvit(method, settings)}
    for name, adapter in peers.items():
        if method in adapter.METHODS:
            builders[name] = lambda adapter=adapter: adapter.build(method, settings)
    return builders


def optimizer(impl: Impl) -> torch.optim.Optimizer:
    params = [p for p in impl.model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1.5e-4, betas=(0.9, 0.95), weight_decay=0.05, fused=True)


def _status(field: str) -> int:
    """A `/proc/self/status` size in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_memory(build, images: torch.Tensor) -> int | None:
    """Bytes of resident memory that building `build()` and one step add, in a forked child."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, leave without running the parent's exit handlers
        try:
            os.close(read)
            warm = Impl(torch.nn.Linear(8, 8), lambda x: x.sum())  # torch's own first-step allocations
            one_step(Impl(warm.model, lambda x: warm.model(x).sum()), optimizer(warm), torch.zeros(2, 8))
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            start = _status("VmRSS")
            impl = build()
            one_step(impl, optimizer(impl), images)
            os.write(write, str(_status("VmHWM") - start).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return int(text) if text else None


def time_method(builders: dict, images: torch.Tensor, rounds: int) -> dict:
    """name -> step times (s), one per round, the implementations interleaved, and the FLOPs of the
    untimed first step."""
    built, flops = {}, {}
    for name, build in builders.items():
        torch.manual_seed(0)
        impl = build()
        built[name] = (impl, optimizer(impl))
        with FlopCounterMode(display=False) as counter:  # untimed: first-call allocations, lazy inits
            one_step(impl, built[name][1], images)
        flops[name] = counter.get_total_flops()
    names = list(built)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            impl, opt = built[name]
            start = time.perf_counter()
            one_step(impl, opt, images)
            times[name].append(time.perf_counter() - start)
    params = {name: trainable(impl.model) for name, (impl, _) in built.items()}
    del built
    gc.collect()
    return {"times": times, "params": params, "flops": flops}


def summarise(rows: list[dict]) -> list[dict]:
    """Median img/s, its ratio to the fastest implementation of the same method and variant."""
    for row in rows:
        row["median_s"] = statistics.median(row["times"])
        row["img_s"] = row["batch_size"] / row["median_s"]
    for row in rows:
        group = [r for r in rows if (r["variant"], r["method"]) == (row["variant"], row["method"])]
        row["ratio"] = row["img_s"] / max(r["img_s"] for r in group)
    return rows


def beyond_noise(row: dict, rows: list[dict]) -> str:
    """Whether `row` is slower than the fastest implementation of its method beyond the rounds' spread:
    its fastest round slower than every round of the fastest's."""
    group = [r for r in rows if (r["variant"], r["method"]) == (row["variant"], row["method"])]
    fastest = max(group, key=lambda r: r["img_s"])
    if min(row["times"]) > max(fastest["times"]):
        return "beyond the spread"
    return "the spreads overlap: no difference measured"


def table(rows: list[dict]) -> str:
    lines = [
        "| variant | method | implementation | img/s | ratio to fastest "
        "| step s: median (fastest, slowest round) | GFLOP per step | params (M) | peak memory (MiB) |",
        "|---|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        memory = f"{r['peak_bytes'] / 2**20:.0f}" if r["peak_bytes"] else "n/a"
        lines.append(
            f"| {r['variant']} | {r['method']} | {r['implementation']} | {r['img_s']:.2f} | {r['ratio']:.2f} "
            f"| {r['median_s']:.2f} ({min(r['times']):.2f}, {max(r['times']):.2f}) | {r['flops'] / 1e9:.0f} "
            f"| {r['params'] / 1e6:.1f} | {memory} |"
        )
    return "\n".join(lines)


def machine(peers: dict) -> dict:
    from importlib.metadata import version

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "timm": version("timm"),
        "peers": ", ".join(f"{name} {version(name)}" for name in peers),
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["S/16", "B/16"])
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--peers", nargs="+", default=list(ADAPTERS), choices=ADAPTERS)
    parser.add_argument("--decoder-dim", type=int, default=512)
    parser.add_argument("--decoder-depth", type=int, default=8)
    parser.add_argument("--decoder-heads", type=int, default=16)
    parser.add_argument("--no-memory", action="store_true", help="skip the forked peak-memory runs")
    parser.add_argument("--json", type=Path, help="write every round's times here")
    parser.add_argument("--results", type=Path, help="write the RESULTS.md page here")
    args = parser.parse_args(argv)
    peers = {}
    for module in args.peers:
        adapter = __import__(module)
        peers[adapter.PEER] = adapter
    plan = []
    for variant in args.variants:
        settings = Settings(variant, args.img_size, args.decoder_dim, args.decoder_depth, args.decoder_heads)
        for method in args.methods:
            builders = implementations(method, settings, peers)
            if len(builders) > 1:  # a method no peer has is not compared
                plan.append((variant, method, builders))
    torch.manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    load = [os.getloadavg()]
    memory = {}
    if not args.no_memory:  # before any timing: the children fork a process that has run no step
        for variant, method, builders in plan:
            for name, build in builders.items():
                memory[variant, method, name] = peak_memory(build, images)
                print(f"memory {variant} {method} {name}: {memory[variant, method, name]}", flush=True)
    rows = []
    for variant, method, builders in plan:
        measured = time_method(builders, images, args.rounds)
        for name, times in measured["times"].items():
            rows.append(dict(
                variant=variant, method=method, implementation=name, batch_size=args.batch_size,
                times=times, params=measured["params"][name], flops=measured["flops"][name],
                peak_bytes=memory.get((variant, method, name)),
            ))  # fmt: skip
            print(f"{variant} {method} {name}: " + " ".join(f"{t:.2f}" for t in times), flush=True)
    load.append(os.getloadavg())
    rows = summarise(rows)
    report = {"machine": machine(peers), "load_average": load, "argv": sys.argv, "rows": rows}
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.results:
        args.results.write_text(results_page(report, table(rows)))
    return 0


def results_page(report: dict, rows_table: str) -> str:
    """benchmarks/peers/RESULTS.md: the table with the machine, the command and the load it ran under."""
    m = report["machine"]
    (start, *_), (end, *_) = report["load_average"]
    command = " ".join(["python", *report["argv"]])
    slower = [
        f"{r['variant']} {r['method']}: ssl-vit {r['ratio']:.3f}x the fastest, "
        f"{beyond_noise(r, report['rows'])}"
        for r in report["rows"]
        if r["implementation"] == "ssl-vit" and r["ratio"] < 1.0
    ]
    return f"""# ssl-vit beside its peers: speed of one training step

Written by benchmarks/peers/speed.py (`make peers` runs it); measured, not edited by hand.

- command: `{command}`
- machine: {m["cpu"]}, {m["cores"]} cores, torch {m["torch"]} with {m["torch_threads"]} thread(s),
  timm {m["timm"]}, {m["peers"]}, Python {m["python"]}
- load average (1 min) at the start and the end: {start:.2f}, {end:.2f}
- the step: forward, loss, backward, fused AdamW, zero_grad; one untimed step each, then one step of
  every implementation per round, the order rotated each round; the median over rounds, with the
  fastest and slowest round as its spread (the noise)
- GFLOP per step: forward and backward of the untimed step (one draw of the masks); a method whose
  implementations differ here does different work in each (the adapters' docstrings say what differs)
- peak memory: what building the model and one step add to the resident memory, in a forked child

{rows_table}

Where ssl-vit is below the fastest: {"; ".join(slower) if slower else "nowhere"}.
"""


if __name__ == "__main__":
    sys.exit(main())
