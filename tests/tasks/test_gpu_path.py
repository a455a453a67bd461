"""The GPU path, checked for correctness on the CPU: compiled blocks and steps, activation
checkpointing, fused AdamW and bf16 in the GPU recipes, timm's fused attention."""

import copy
import pickle
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import yaml
from cli_helpers import free_port, start_ranks
from ddp_compile_helpers import TINY as DDP_TINY  # next to this file; pytest puts its folder on sys.path
from ddp_compile_helpers import batch_of, compiled_ddp_gradients
from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ssl_vit.benchmark import COMPILE_MODES
from ssl_vit.errors import UserError
from ssl_vit.masking import MASK, RANDOM, bert_corruption
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks import MaskedPatchPretraining, SupervisedPretraining
from ssl_vit.tasks.base import step_loss
from ssl_vit.tasks.compile import CompileTask, Mode, compile_blocks, compile_step, compiled_step
from ssl_vit.tasks.masked import MaskedOutput

ROOT = Path(__file__).resolve().parents[2]
TINY = ViTConfig("S/8", 32, width=64, depth=2, heads=2)


def mae(config: ViTConfig = TINY) -> MaskedPatchPretraining:
    torch.manual_seed(0)
    return MaskedPatchPretraining(config, preset="mae", decoder_dim=32, decoder_depth=1, decoder_heads=2)


def loss_and_grads(task, images, labels=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`train_loss` as the training step calls it, its masks drawn from the global RNG seeded at 3."""
    task.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out = task.train_loss({"image": images} if labels is None else {"image": images, "label": labels})
    loss = step_loss(out)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in task.named_parameters() if p.grad is not None}


def assert_same(a, b, atol) -> None:
    loss_a, grads_a = a
    loss_b, grads_b = b
    torch.testing.assert_close(loss_a, loss_b, atol=atol, rtol=0)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 20
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_loss_and_gradients(digits_batch):
    """Encoder and decoder blocks compiled by inductor (the CPU's C++ backend here, Triton on CUDA)."""
    images = digits_batch["image"][:8]
    task = mae()
    eager = loss_and_grads(task, images)
    names = list(task.state_dict())
    assert compile_blocks(task) == 3  # 2 encoder blocks, 1 decoder block
    compiled = loss_and_grads(task, images)
    assert_same(eager, compiled, atol=1e-5)
    assert list(task.state_dict()) == names  # checkpoints keep their keys
    assert all(block._compiled_call_impl is not None for block in task.backbone.blocks)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["supervised", "mae", "vit_mpp", "maskfeat"])
def test_a_compiled_step_gives_the_eager_loss_and_gradients(digits_batch, preset):
    """`--compile.scope step`: the whole `train_loss` (masks, gathers, encoder, decoder, targets, loss)
    as one graph. Inductor draws random numbers its own way; `fallback_random` makes it draw torch's,
    so both sides mask the same patches."""
    torch._dynamo.reset()
    images, labels = digits_batch["image"][:8], digits_batch["label"][:8] % 10
    torch.manual_seed(0)
    if preset == "supervised":
        task = SupervisedPretraining(TINY, num_classes=10)
    else:
        task = MaskedPatchPretraining(TINY, preset=preset, decoder_dim=32, decoder_depth=1, decoder_heads=2)
    eager = loss_and_grads(task, images, labels)
    names = list(task.state_dict())
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    compile_step(task)
    with torch._inductor.config.patch(fallback_random=True):
        compiled = loss_and_grads(task, images, labels)
        compiled_graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        again = loss_and_grads(task, images, labels)
    assert compiled_graphs > graphs  # it did compile
    assert dynamo_utils.counters["stats"]["unique_graphs"] == compiled_graphs  # and reused it
    assert_same(eager, compiled, atol=1e-5)
    assert_same(compiled, again, atol=0)  # same seed, same masks, same numbers
    assert list(task.state_dict()) == names


@pytest.mark.slow
def test_a_compiled_mpp_step_is_one_graph_whatever_its_80_10_10_split(digits_batch):
    """MPP's group sizes change from step to step (stochastic rounding), but its corruption keeps
    them on the device in fixed shapes: the step compiles once, as one graph, and gives eager's
    numbers at every split. MAE compiled after it in the same process (as `bench step` runs them)
    is one graph of its own too. Graphs are dynamo's, whatever runs them: aot_eager runs them here
    (inductor's kernels of both steps are checked in the test above; here they took 40 s to compile)."""
    torch._dynamo.reset()
    batch = {"image": digits_batch["image"][:4], "label": digits_batch["label"][:4] % 10}
    torch.manual_seed(0)
    task = MaskedPatchPretraining(TINY, preset="vit_mpp")
    compiled = MaskedPatchPretraining(TINY, preset="vit_mpp")
    compiled.load_state_dict(task.state_dict())
    compile_step(compiled, backend="aot_eager")
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    splits, graphs = set(), []
    for seed in range(10):
        torch.manual_seed(seed)
        expected = task.train_loss(batch)
        torch.manual_seed(seed)
        got = compiled.train_loss(batch)
        torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=0)
        got.loss.backward()
        torch.manual_seed(seed)
        c = bert_corruption(4, task.num_patches, task.mask_ratio)
        splits.add((c.of(MASK).shape[1], c.of(RANDOM).shape[1]))
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"] - before)
    assert len(splits) == 3  # every split this batch can draw was seen (6/1/1, 7/0/1, 7/1/0 of 8)
    assert graphs == [1] * 10  # one graph, never recompiled
    mae = MaskedPatchPretraining(TINY, preset="mae", decoder_dim=32, decoder_depth=1, decoder_heads=2)
    compile_step(mae, backend="aot_eager")
    mae.train_loss(batch).loss.backward()
    assert dynamo_utils.counters["stats"]["unique_graphs"] - before == 2


@pytest.mark.slow
def test_ddp_averages_the_gradients_of_a_compiled_step(tmp_path):
    """`--compile.scope step` under DDP: 2 ranks (gloo), each backward through its compiled step, split
    by torch at DDP's gradient buckets so their all-reduce overlaps the backward; each rank ends with
    the mean of both ranks' eager gradients."""
    start_ranks(compiled_ddp_gradients, 2, free_port(), str(tmp_path))
    torch.manual_seed(0)
    task = SupervisedPretraining(DDP_TINY, num_classes=10)
    for rank in range(2):
        task.train_loss(batch_of(rank)).backward()
    expected = {name: p.grad / 2 for name, p in task.named_parameters() if p.grad is not None}
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["compiled_graphs"] > 2  # the step, split at the gradient buckets
        got = saved["grads"]
        assert got.keys() == expected.keys() and len(got) > 20
        for name in got:
            torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


class HostWork(TorchDispatchMode):
    """Records every op that returns a tensor on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += 1
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_flatten(out)[0]):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("preset", ["supervised", "mae", "simmim", "vit_mpp", "maskfeat"])
def test_a_training_step_on_cuda_stays_on_the_device(preset):
    """What CUDA graphs and an unsynchronised GPU need: each task's `train_loss` on CUDA makes no CPU
    tensor and reads nothing back to the host (`.item()`, or an op whose output shape depends on the
    data, raises under fake tensors). Checked with fake CUDA tensors, so no GPU is needed."""
    torch.manual_seed(0)
    if preset == "supervised":
        task = SupervisedPretraining(TINY, num_classes=10)
    else:
        task = MaskedPatchPretraining(TINY, preset=preset, decoder_dim=32, decoder_depth=1, decoder_heads=2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        task = task.to("cuda")
        batch = {"image": torch.randn(4, 3, 32, 32, device="cuda"), "label": torch.arange(4, device="cuda")}
        with HostWork() as host:
            out = task.train_loss(batch)
    loss = step_loss(out)
    assert loss.device.type == "cuda" and host.count > 100
    assert host.ops == []


def test_a_cuda_graph_step_marks_each_step_and_hands_back_copies(digits_batch, monkeypatch):
    """With CUDA graphs (`reduce-overhead`) every call starts a new step and returns copies: the graph
    replays into the same memory, and Lightning keeps the logged loss past the next step. (On the CPU
    inductor runs without CUDA graphs; what is checked here is the wrapper around them.)"""
    torch._dynamo.reset()
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    torch.manual_seed(0)
    task = SupervisedPretraining(TINY, num_classes=10)
    batch = {"image": digits_batch["image"][:4], "label": digits_batch["label"][:4] % 10}
    eager = task.train_loss(batch).detach()
    compile_step(task, "reduce-overhead")
    losses = [task.train_loss(batch) for _ in range(2)]
    assert marks == [1, 1]
    assert losses[0].data_ptr() != losses[1].data_ptr()
    torch.testing.assert_close(losses[0].detach(), eager, atol=1e-5, rtol=0)


def test_a_cuda_graph_steps_named_outputs_are_copied_tensor_by_tensor(monkeypatch):
    """A masked task's step returns a `MaskedOutput`: under CUDA graphs each of its tensors is copied (the
    next replay reuses their memory), its empty fields stay None and its type stays."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # (the wrapper is what is checked)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    tensors = [torch.ones(()), torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.long)]
    held = MaskedOutput(*tensors, accuracy=None, monitor_features={"student": torch.ones(2, 4)})
    out = compiled_step(lambda: held, "reduce-overhead")()
    assert type(out) is MaskedOutput and out.accuracy is None and out.teacher is None
    pairs = [*zip(out[:4], tensors), (out.monitor_features["student"], held.monitor_features["student"])]
    for mine, theirs in pairs:
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr()


def test_a_step_is_compiled_once_and_copies_get_the_plain_method(digits_batch):
    """A second `fit` (or a `test` first) sets the task up again: its step is not wrapped twice. A deep
    copy or a pickle of a compiled task holds the plain method (the compiled one is bound to the
    original and its weights)."""
    task = SupervisedPretraining(TINY, num_classes=10)
    assert compile_step(task, "reduce-overhead") and not compile_step(task)
    twin = copy.deepcopy(task)
    assert "train_loss" in vars(task) and "train_loss" not in vars(twin)
    assert twin.train_loss.__self__ is twin
    restored = pickle.loads(pickle.dumps(task))
    batch = {"image": digits_batch["image"][:2], "label": digits_batch["label"][:2] % 10}
    torch.testing.assert_close(restored.train_loss(batch), twin.train_loss(batch))


@pytest.mark.parametrize("scope", ["blocks", "step"])
@pytest.mark.parametrize("accumulate,strategy", [(4, DDPStrategy()), (1, ModelParallelStrategy())])
def test_the_callback_refuses_cuda_graphs_where_they_cannot_work(scope, accumulate, strategy):
    """Gradient accumulation or FSDP, also for a Trainer built in Python (where the CLI's own check never
    ran); nothing is compiled. Without CUDA graphs, both compile."""
    task = SupervisedPretraining(TINY, num_classes=10)
    train_loss = task.train_loss
    trainer = SimpleNamespace(accumulate_grad_batches=accumulate, strategy=strategy)
    with pytest.raises(UserError, match="accumulate_grad_batches 4" if accumulate > 1 else "ModelParallel"):
        CompileTask(True, "reduce-overhead", scope).setup(trainer, task, "fit")
    assert task.train_loss == train_loss
    assert all(block._compiled_call_impl is None for block in task.backbone.blocks)
    CompileTask(True, "default", scope).setup(trainer, task, "fit")
    assert (task.train_loss != train_loss) == (scope == "step")


def test_the_backend_and_the_mode_reach_torch_compile(monkeypatch):
    """`--compile.backend` is what torch.compile gets, for the blocks and the step (a mode for
    inductor, none for the others); a mode with another backend is refused by Python callers too."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: calls.append(options) or fn)
    trainer = SimpleNamespace(accumulate_grad_batches=1, strategy=DDPStrategy())
    for scope, backend, mode, expected in [
        ("blocks", "aot_eager", "default", [{"backend": "aot_eager"}] * 2),  # TINY's 2 blocks
        ("step", "eager", "default", [{"backend": "eager"}]),
        ("step", "inductor", "max-autotune-no-cudagraphs", [{"mode": "max-autotune-no-cudagraphs"}]),
    ]:
        calls.clear()
        CompileTask(True, mode, scope, backend).setup(
            trainer, SupervisedPretraining(TINY, num_classes=10), "fit"
        )
        assert calls == expected, (scope, backend)
    with pytest.raises(UserError, match="reduce-overhead is a setting of inductor, not of --compile.backend"):
        compile_step(SupervisedPretraining(TINY, num_classes=10), "reduce-overhead", "aot_eager")


def test_the_bench_offers_every_compile_mode_the_tasks_take():
    assert COMPILE_MODES == Mode.__args__


def test_activation_checkpointing_gives_the_same_gradients(digits_batch):
    images = digits_batch["image"][:8]
    plain, checkpointed = mae(), mae(replace(TINY, grad_checkpointing=True))
    checkpointed.load_state_dict(plain.state_dict())
    assert checkpointed.backbone.grad_checkpointing and not plain.backbone.grad_checkpointing
    assert_same(loss_and_grads(plain, images), loss_and_grads(checkpointed, images), atol=1e-6)


def test_activation_checkpointing_recomputes_the_blocks_in_the_backward(digits_batch):
    """Without it each block runs once per step; with it, twice (forward, then again in the backward;
    a pre-hook counts it: torch stops the recomputation early, before the block's output)."""
    calls = []
    for checkpointing in (False, True):
        task = SupervisedPretraining(replace(TINY, grad_checkpointing=checkpointing), num_classes=10)
        starts = []
        task.backbone.blocks[0].register_forward_pre_hook(lambda *_, starts=starts: starts.append(1))
        task.backbone(digits_batch["image"][:4]).sum().backward()
        calls.append(len(starts))
    assert calls == [1, 2]


def gpu_recipes() -> list[Path]:
    """Every recipe whose trainer runs on GPUs."""
    found = []
    for path in sorted(ROOT.glob("recipes/*/*.yaml")):
        recipe = yaml.safe_load(path.read_text())
        trainer = recipe.get("trainer") if isinstance(recipe, dict) else None
        if isinstance(trainer, str):
            trainer = yaml.safe_load((path.parent / trainer).read_text())
        # A recipe names its model's class; a file given after one (recipes/study/gpu.yaml) is checked
        # composed with each recipe it serves, in tests/test_study.py.
        model = recipe.get("model") if isinstance(recipe, dict) else None
        on_gpu = isinstance(trainer, dict) and trainer.get("accelerator") == "gpu"
        if on_gpu and "class_path" in (model or {}):
            found.append(path)
    return found


@pytest.mark.parametrize("path", gpu_recipes(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_gpu_recipes_use_bf16_and_a_fused_optimizer(path):
    recipe = yaml.safe_load(path.read_text())
    trainer = recipe["trainer"]
    trainer = yaml.safe_load((path.parent / trainer).read_text()) if isinstance(trainer, str) else trainer
    assert trainer["precision"] == "bf16-mixed"
    optimizer = recipe["model"]["init_args"]["training"]["optimizer"]
    assert optimizer["init_args"].get("fused") is True, f"{path}: the optimizer should be fused on CUDA"


def test_there_are_gpu_recipes_to_check():
    assert len(gpu_recipes()) >= 8


def test_fused_adamw_steps_as_the_loop_implementation(digits_batch):
    """`fused: true` in a recipe changes the kernel, not the update (it also runs on the CPU)."""
    results = []
    for fused in (False, True):
        task = mae()
        optimizer = torch.optim.AdamW(task.parameters(), lr=1e-2, fused=fused, foreach=not fused and None)
        for _ in range(2):
            loss_and_grads(task, digits_batch["image"][:8])
            optimizer.step()
        results.append(task.state_dict())
    # Except the qkv biases: their key third has a gradient that is zero up to rounding (softmax does
    # not change when a constant is added to a row's logits), which Adam scales up to a full step of
    # a rounding-dependent sign.
    for name in [n for n in results[0] if not n.endswith("qkv.bias")]:
        torch.testing.assert_close(results[0][name], results[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_attention_runs_through_the_fused_sdpa_path():
    """timm's Attention calls F.scaled_dot_product_attention (flash / memory-efficient kernels on GPU)
    when `fused_attn` is set; `TIMM_FUSED_ATTN=0` would turn it off."""
    task = mae()
    blocks = [*task.backbone.blocks, *task.decoder.blocks]
    assert blocks and all(block.attn.fused_attn for block in blocks)


@pytest.mark.parametrize("preset", ["vit_mpp", "mae", "simmim"])
def test_every_masked_objective_trains_under_bf16_autocast(digits_batch, preset):
    """The GPU recipes train in bf16-mixed: every objective's loss and gradients under bf16 autocast
    (the CPU's here, the same dtype rules as CUDA's) are finite and near the fp32 ones."""
    images = digits_batch["image"][:8]
    torch.manual_seed(0)
    task = MaskedPatchPretraining(
        TINY, preset=preset, cell_size=16, decoder_dim=32, decoder_depth=1, decoder_heads=2
    )
    fp32 = loss_and_grads(task, images)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = loss_and_grads(task, images)
    assert torch.isfinite(bf16[0]) and all(torch.isfinite(g).all() for g in bf16[1].values())
    torch.testing.assert_close(bf16[0], fp32[0], atol=0.05, rtol=0.05)
    assert bf16[1].keys() == fp32[1].keys()


def test_supervised_trains_under_bf16_autocast(digits_batch):
    torch.manual_seed(0)
    task = SupervisedPretraining(TINY, num_classes=10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = task(digits_batch["image"][:8])
        loss = task.forward_loss(logits, {"label": digits_batch["label"][:8]})
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in task.parameters() if p.grad is not None)


def test_counting_flops_runs_compiled_blocks_eagerly_and_leaves_them_compiled(digits_batch):
    """The task counts its FLOPs at the first batch, after `--compile` compiled its blocks. On CUDA
    (torch 2.11, H200), compiled blocks called under the counter's dispatch mode ran eager for the rest
    of the process, so counting undid `--compile` (`benchmarks/gpu.sh` compile on vs off shows it);
    the count now runs with torch.compiler's eager stance. Here: the count is the eager one, and the
    blocks still compile and run compiled code afterwards (aot_eager's: the stance is dynamo's)."""
    torch._dynamo.reset()  # shapes start static whatever earlier tests compiled: a new batch size recompiles
    images = digits_batch["image"][:4]
    eager = mae()
    eager.measure_flops(images)
    task = mae()
    compile_blocks(task, backend="aot_eager")
    loss_and_grads(task, images)
    frames = dynamo_utils.counters["frames"]["ok"]
    stances = []
    hook = task.backbone.blocks[0].register_forward_pre_hook(
        lambda *_: stances.append(torch.compiler.is_compiling())
    )
    task.measure_flops(images)
    hook.remove()
    assert task.flops_per_image == eager.flops_per_image > 0
    assert stances == [False]  # the counted forward ran eagerly, outside any compiled frame
    loss_and_grads(task, images[:3])  # a new batch size: dynamo is still there to compile it
    assert dynamo_utils.counters["frames"]["ok"] > frames
