"""Where modules lived before the package took its present layout, so that what names them by their old
paths keeps working: run configs (`config.yaml` of a run names `ssl_vit.tasks.checkpointing.
SafeCheckpointIO`), users' recipes and scripts. One table, and a finder that answers an old name with the
module now at the new one (the same module object, not a copy). A grep for an old path lands here.

Importing an old path warns (`DeprecationWarning`, naming the new path), attributed to the line that
imported it: Python's default filters show it where that line is a script's (`__main__`), not where
a library imports it for a config or a checkpoint. A module that was split answers at its old path with
the part that kept its main names; a name that left it is found only at its new home. A module whose
old path is now a package's (`ssl_vit.data.stream`, `ssl_vit.data.transforms`, `ssl_vit.targets`)
cannot answer there: its names are in `ssl_vit.data.stream.pipeline`, `ssl_vit.data.transforms.rgb`,
`ssl_vit.targets.patches` and each target's module. The old package of sources, `ssl_vit.data.sources`,
answers with `ssl_vit.data.convert`, which holds its modules and its registry's names."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "ssl_vit.tasks.checkpointing": "ssl_vit.checkpoints.store",
    "ssl_vit.tasks.nonfinite": "ssl_vit.run.nonfinite",
    "ssl_vit.tasks.preemption": "ssl_vit.run.preemption",
    "ssl_vit.tasks.rollback": "ssl_vit.run.rollback",
    "ssl_vit.tasks.health": "ssl_vit.run.health",
    "ssl_vit.tasks.resume": "ssl_vit.run.resume",
    "ssl_vit.tasks.spikes": "ssl_vit.run.spikes",
    "ssl_vit.run_lock": "ssl_vit.storage.lock",
    "ssl_vit.evaluation.report": "ssl_vit.report.writer",
    "ssl_vit.evaluation.tables": "ssl_vit.report.tables",
    "ssl_vit.evaluation.plots": "ssl_vit.report.plots",
    "ssl_vit.evaluation.verdicts": "ssl_vit.report.verdicts",
    "ssl_vit.evaluation.progress": "ssl_vit.progress",
    "ssl_vit.data.bench": "ssl_vit.benchmark.data",
    "ssl_vit.fit": "ssl_vit.cli.fit",
    "ssl_vit.data.commands": "ssl_vit.cli.data",
    "ssl_vit.evaluation.commands": "ssl_vit.cli.evaluate",
    "ssl_vit.evaluation.training": "ssl_vit.evaluation.trained",
    "ssl_vit.analysis.commands": "ssl_vit.cli.analyze",
    "ssl_vit.checkpoints.commands": "ssl_vit.cli.export",
    "ssl_vit.benchmark.commands": "ssl_vit.cli.bench",
    "ssl_vit.info": "ssl_vit.cli.info",
    "ssl_vit.evaluation.kinds.fewshot": "ssl_vit.evaluation.kinds.fewshot_protocol",
    "ssl_vit.evaluation.kinds.knn": "ssl_vit.evaluation.kinds.knn_protocol",
    "ssl_vit.evaluation.kinds.linear_probe": "ssl_vit.evaluation.kinds.linear_probe_protocol",
    "ssl_vit.evaluation.kinds.attentive_probe": "ssl_vit.evaluation.kinds.attentive_probe_protocol",
    "ssl_vit.evaluation.kinds.finetune": "ssl_vit.evaluation.kinds.finetune_protocol",
    "ssl_vit.evaluation.kinds.linear_seg": "ssl_vit.evaluation.kinds.linear_seg_protocol",
    "ssl_vit.evaluation.kinds.probe": "ssl_vit.evaluation.kinds.probe_protocol",
    "ssl_vit.data.imagenet": "ssl_vit.data.convert.imagenet",
    "ssl_vit.data.eurosat": "ssl_vit.data.convert.eurosat",
    "ssl_vit.data.arrays_source": "ssl_vit.data.convert.tiff",
    "ssl_vit.atomic": "ssl_vit.storage.atomic",
    "ssl_vit.lock": "ssl_vit.storage.lock",
    "ssl_vit.outdir": "ssl_vit.storage.outdir",
    "ssl_vit.data.remote": "ssl_vit.storage.remote",
    "ssl_vit.data.manifest": "ssl_vit.data.format.manifest",
    "ssl_vit.data.arrays": "ssl_vit.data.format.arrays",
    "ssl_vit.data.band_stats": "ssl_vit.data.format.band_stats",
    "ssl_vit.data.masks": "ssl_vit.data.format.masks",
    "ssl_vit.data.band_transforms": "ssl_vit.data.transforms.bands",
    "ssl_vit.data.mixing": "ssl_vit.data.transforms.mixing",
    "ssl_vit.data.urls": "ssl_vit.data.stream.urls",
    "ssl_vit.data.tar_reader": "ssl_vit.data.stream.tar_reader",
    "ssl_vit.data.samples": "ssl_vit.data.stream.samples",
    "ssl_vit.data.epoch_order": "ssl_vit.data.stream.epoch_order",
    "ssl_vit.data.position": "ssl_vit.data.stream.position",
    "ssl_vit.data.identity": "ssl_vit.data.stream.identity",
    "ssl_vit.data.loaders": "ssl_vit.data.stream.loaders",
    "ssl_vit.data.workers": "ssl_vit.data.stream.workers",
    "ssl_vit.data.device_decode": "ssl_vit.data.stream.device_decode",
    "ssl_vit.data.class_mix": "ssl_vit.data.stream.class_mix",
    "ssl_vit.data.sources": "ssl_vit.data.convert",
    "ssl_vit.data.sources.digits": "ssl_vit.data.convert.digits",
    "ssl_vit.data.sources.synthetic": "ssl_vit.data.convert.synthetic",
    "ssl_vit.data.sources.imagefolder": "ssl_vit.data.convert.imagefolder",
    "ssl_vit.data.sources.cifar": "ssl_vit.data.convert.cifar",
    "ssl_vit.data.sources.idx": "ssl_vit.data.convert.idx",
    "ssl_vit.data.sources.npz": "ssl_vit.data.convert.npz",
    "ssl_vit.data.sources.wds": "ssl_vit.data.convert.wds",
    "ssl_vit.data.sources.imagenet": "ssl_vit.data.convert.imagenet",
    "ssl_vit.data.sources.hf": "ssl_vit.data.convert.hf",
    "ssl_vit.data.sources.ade20k": "ssl_vit.data.convert.ade20k",
    "ssl_vit.data.sources.voc": "ssl_vit.data.convert.voc",
    "ssl_vit.data.sources.mosaic": "ssl_vit.data.convert.mosaic",
    "ssl_vit.data.sources.tiff": "ssl_vit.data.convert.tiff",
    "ssl_vit.data.sources.eurosat": "ssl_vit.data.convert.eurosat",
    "ssl_vit.data.hf_source": "ssl_vit.data.convert.hf",
    "ssl_vit.data.wds_source": "ssl_vit.data.convert.wds",
    "ssl_vit.data.mosaic": "ssl_vit.data.convert.mosaic",
    "ssl_vit.data.encode": "ssl_vit.data.convert.encode",
    "ssl_vit.data.writer": "ssl_vit.data.convert.shard_writer",
    "ssl_vit.tasks.target": "ssl_vit.targets.target",
    "ssl_vit.tasks.pictures": "ssl_vit.targets.masked_picture",
    "ssl_vit.tasks.targets": "ssl_vit.targets",
    "ssl_vit.tasks.targets.color3bit_target": "ssl_vit.targets.color3bit_target",
    "ssl_vit.tasks.targets.color3bit_4x4_target": "ssl_vit.targets.color3bit_4x4_target",
    "ssl_vit.tasks.targets.pixels_target": "ssl_vit.targets.pixels_target",
    "ssl_vit.tasks.targets.norm_pixels_target": "ssl_vit.targets.norm_pixels_target",
    "ssl_vit.tasks.targets.hog_target": "ssl_vit.targets.hog_target",
    "ssl_vit.tasks.targets.teacher_target": "ssl_vit.targets.teacher_target",
    "ssl_vit.run.checkpointing": "ssl_vit.checkpoints.store",
    "ssl_vit.run.checks": "ssl_vit.run.preflight",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of `MOVED`; loading it imports the new module and puts that very module in
    `sys.modules` under the old name too (the import system returns what `sys.modules` holds after
    `exec_module`), so classes keep one identity whichever name imported them."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None  # the default module, replaced in exec_module

    def exec_module(self, module) -> None:
        old, new = module.__name__, MOVED[module.__name__]
        # stacklevel 2: the warnings module passes over the import system's frames to the importing line
        warnings.warn(f"{old} moved to {new}: import {new}", DeprecationWarning, stacklevel=2)
        sys.modules[old] = importlib.import_module(new)


def install() -> None:
    # First: an old name is the new module's whatever else could answer it (an editable install's finder
    # answers a package's direct children from its own checkout, where an old file may still lie).
    if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Moved())
