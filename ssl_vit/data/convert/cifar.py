"""`cifar10:DIR` and `cifar100:DIR`: the CIFAR python batches, unpickled allowing numpy arrays only."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from ssl_vit.data.convert.source import SourceKind, check_split, register
from ssl_vit.errors import UserError


class _ArrayUnpickler(pickle.Unpickler):
    """CIFAR's python batches are pickles; load them allowing only numpy arrays, never arbitrary
    classes (an untrusted pickle can otherwise run code)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _load_cifar_pickle(path: Path) -> dict:
    if not path.is_file():
        raise UserError(
            f"{path}: missing; expected the CIFAR python batches (cifar-*-python.tar.gz, extracted)"
        )
    try:
        with open(path, "rb") as f:
            raw = _ArrayUnpickler(f, encoding="bytes").load()
        if not isinstance(raw, dict):
            raise ValueError("not a dict")
    except Exception as err:
        raise UserError(f"{path}: does not parse as a CIFAR python batch ({err})") from None
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}


def _cifar(root: Path, batch_names: list[str], meta_name: str, label_key: str, names_key: str):
    if (root / "cifar-10-batches-py").is_dir() or (root / "cifar-100-python").is_dir():
        root = next(p for p in (root / "cifar-10-batches-py", root / "cifar-100-python") if p.is_dir())
    if not root.is_dir():
        raise UserError(f"{root}: no such directory")
    meta = _load_cifar_pickle(root / meta_name)
    class_names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta.get(names_key, [])]
    records = []
    for name in batch_names:
        batch = _load_cifar_pickle(root / name)
        data, labels = np.asarray(batch.get("data")), batch.get(label_key)
        if (
            data.ndim != 2
            or data.shape[1] != 3072
            or data.dtype != np.uint8
            or labels is None
            or len(labels) != len(data)
        ):
            raise UserError(
                f"{root / name}: expected 'data' uint8 (N, 3072) and '{label_key}' with N entries"
            )
        images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        records += [(img, int(lab)) for img, lab in zip(images, labels)]
    return class_names, records


def load_cifar10(arg: str, split: str) -> tuple[list[str], list]:
    """CIFAR-10's python batches (`cifar-10-python.tar.gz`, extracted): DIR or its `cifar-10-batches-py`."""
    check_split("cifar10", split, ("train", "test"))
    batches = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    return _cifar(Path(arg), batches, "batches.meta", "labels", "label_names")


def load_cifar100(arg: str, split: str) -> tuple[list[str], list]:
    """CIFAR-100's python batches (`cifar-100-python.tar.gz`, extracted), with its 100 fine labels."""
    check_split("cifar100", split, ("train", "test"))
    return _cifar(Path(arg), [split], "meta", "fine_labels", "fine_label_names")


register(SourceKind("cifar10", load_cifar10, "DIR", splits="train|test"))
register(SourceKind("cifar100", load_cifar100, "DIR", splits="train|test"))
