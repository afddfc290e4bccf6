"""CIFAR-10 on the host, in numpy (no JAX): read, split, batch.

Reads the official python-format folder ``<data-dir>/cifar-10-batches-py/`` once into
uint8 NHWC arrays (32 x 32 x 3), splits it into train / val / test (`load_dataset`), and
cuts global batches: shuffled per epoch with the last partial batch dropped for training
(`train_batches`), zero-padded with a mask for evaluation. Pickles are read with a
restricted unpickler, so a crafted file cannot run code. A missing folder is fetched by
vit_pure/data/download.py (md5-checked, extracted atomically). The device side is
vit_pure/data/augment.py and randaugment.py; vit_pure/run/loop.py is the loop that feeds
these batches to a strategy's `train_step`.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
from typing import Callable, Iterator

import numpy as np

from vit_pure.data.download import FOLDER, HOW_TO_PROVIDE, TEST_FILE, TRAIN_FILES, download_cifar10
from vit_pure.errors import DataError, one_line

# Per-channel statistics of CIFAR-10 on [0, 1]-scaled pixels, as commonly used.
# Note: the stds are the dataset mean of *per-image* stds; the pixel std over the
# whole training set is larger (about 0.247, 0.243, 0.261), so normalised
# training pixels have a std of about 1.2-1.3, not exactly 1. Kept for
# comparability with the many published CIFAR-10 recipes that use them.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")

META_FILE = "batches.meta"
VAL_FRACTION = 0.1                 # 45,000 / 5,000 on the full training set

HEIGHT = WIDTH = 32
CHANNELS = 3
NUM_CLASSES = 10

@dataclasses.dataclass(frozen=True)
class Split:
    images: np.ndarray  # (N, 32, 32, 3) uint8, NHWC
    labels: np.ndarray  # (N,) int32, in 0..9

    def __len__(self) -> int:
        return int(self.labels.shape[0])


# --------------------------------------------------------------------------
# Restricted unpickling
# --------------------------------------------------------------------------

def _allowed_globals() -> dict[tuple[str, str], object]:
    """The only globals a CIFAR-10 batch pickle needs, mapped to the objects.

    Official files (Python 2, protocol 2) name ``numpy.core.multiarray._reconstruct``,
    ``numpy.ndarray`` and ``numpy.dtype``. Files re-pickled by numpy 2 name
    ``numpy._core...``; Python 3 at protocol 2 writes bytes as ``_codecs.encode``;
    protocol 5 writes arrays via ``_frombuffer``. None of these can run code.
    The objects are looked up here, never imported by the name in the file.
    """
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    numeric = np._core.numeric if hasattr(np, "_core") else np.core.numeric
    import _codecs

    allowed = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _codecs.encode,
    }
    for pkg in ("numpy.core", "numpy._core"):
        allowed[(f"{pkg}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{pkg}.multiarray", "scalar")] = multiarray.scalar
        if hasattr(numeric, "_frombuffer"):
            allowed[(f"{pkg}.numeric", "_frombuffer")] = numeric._frombuffer
    for mod in ("builtins", "__builtin__"):  # Python 3 and Python 2 spellings
        for name, obj in (("list", list), ("dict", dict), ("tuple", tuple), ("set", set),
                          ("frozenset", frozenset), ("bytearray", bytearray)):
            allowed[(mod, name)] = obj
    return allowed


_ALLOWED = _allowed_globals()


class _RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only the globals in ``_ALLOWED``."""

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name} (not part of the CIFAR-10 format)"
            ) from None


def restricted_load(path: str | os.PathLike) -> object:
    """Unpickle a CIFAR-10 python-format file without admitting arbitrary code.

    Raises DataError naming the file if it is missing, truncated, corrupt or
    references anything beyond numpy arrays and plain containers.
    """
    path = pathlib.Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"missing file {path}; {HOW_TO_PROVIDE}") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        # 'latin1' is the documented way to read Python 2 pickles holding numpy arrays.
        return _RestrictedUnpickler(io.BytesIO(raw), encoding="latin1").load()
    except pickle.UnpicklingError as e:
        raise DataError(f"{path}: not a safe CIFAR-10 pickle: {one_line(e)}") from None
    except EOFError:
        raise DataError(f"{path} is truncated (unexpected end of pickle data); "
                        f"delete the folder to download it again") from None
    except Exception as e:  # noqa: BLE001 - any other decoding failure is a bad file
        raise DataError(f"{path} is corrupt or not a CIFAR-10 pickle "
                        f"({type(e).__name__}: {one_line(e)})") from None


# --------------------------------------------------------------------------
# Reading the folder
# --------------------------------------------------------------------------

def _field(d: dict, name: str):
    """A key of a batch dict; the files' keys are str (latin1) or bytes."""
    if name in d:
        return d[name]
    return d.get(name.encode("ascii"))


def read_batch_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> (images (n, 32, 32, 3) uint8 NHWC, labels (n,) int32)."""
    path = pathlib.Path(path)
    d = restricted_load(path)
    if not isinstance(d, dict):
        raise DataError(f"{path}: expected a dict with 'data' and 'labels', got {type(d).__name__}")
    data, labels = _field(d, "data"), _field(d, "labels")
    if data is None or labels is None:
        raise DataError(f"{path}: missing the 'data' or 'labels' entry")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != CHANNELS * HEIGHT * WIDTH:
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise DataError(f"{path}: 'data' must be uint8 of shape (n, {CHANNELS * HEIGHT * WIDTH}), "
                        f"got {dtype} {shape}")
    try:
        labels = np.asarray(labels)
    except Exception:  # noqa: BLE001
        raise DataError(f"{path}: 'labels' is not a list of integers") from None
    if labels.ndim != 1 or labels.shape[0] != data.shape[0] or not (
            labels.dtype.kind in "iu" or (labels.size == 0 and labels.dtype.kind == "f")):
        raise DataError(f"{path}: 'labels' must be {data.shape[0]} integers (one per image), "
                        f"got {labels.dtype} {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        bad = labels[(labels < 0) | (labels >= NUM_CLASSES)][0]
        raise DataError(f"{path}: label {int(bad)} out of range 0..{NUM_CLASSES - 1}")
    # Rows are channel-major (R plane, G plane, B plane); make them NHWC.
    images = np.ascontiguousarray(data.reshape(-1, CHANNELS, HEIGHT, WIDTH).transpose(0, 2, 3, 1))
    return images, labels.astype(np.int32)


def _check_meta(path: pathlib.Path) -> None:
    d = restricted_load(path)
    names = _field(d, "label_names") if isinstance(d, dict) else None
    if names is None or len(names) != NUM_CLASSES:
        raise DataError(f"{path}: expected {NUM_CLASSES} 'label_names'")


def split_indices(n: int, split_seed: int = 0,
                  val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices into the n training images: a fixed-seed split, 90/10 by
    default; `val_fraction` 0 leaves the validation split empty.

    Each index set is sorted, so the splits keep the files' order.
    """
    n_val = int(round(n * val_fraction))
    perm = np.random.default_rng(split_seed).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def _find_folder(data_dir: pathlib.Path) -> pathlib.Path:
    # Accept the parent (the documented form) or the folder itself.
    if data_dir.name == FOLDER and (data_dir / TRAIN_FILES[0]).exists():
        return data_dir
    return data_dir / FOLDER


def load_cifar10(data_dir, *, download: bool = True, url: str | None = None,
                 md5: str | None = None, split_seed: int = 0,
                 subset: tuple[int, int] | None = None, val_fraction: float = VAL_FRACTION,
                 log: Callable[[str], None] = print) -> dict[str, Split]:
    """Read CIFAR-10 from ``data_dir/cifar-10-batches-py`` (downloading it if missing).

    Returns {'train', 'val', 'test'}: the five training batches split 90/10 with a
    fixed-seed permutation (45,000 / 5,000 on the full set; the same ratio on a
    subset; `val_fraction`, --val-fraction, sets another ratio, 0 none), and the test
    batch (10,000). url/md5 default to the environment
    variables VIT_PURE_CIFAR10_URL / VIT_PURE_CIFAR10_MD5, then to the official ones.

    `subset` (n_train, n_test), `--subset`: the first n_train / 5 images of each training
    batch and the first n_test of the test batch, before the split. (4000, 1000) is the
    CIFAR-10 subset the tests and the cpu-quick recipe use; taken from a folder that
    already holds that subset, it is the whole folder.
    """
    if subset is not None:
        check_subset(subset)
    if data_dir is None or str(data_dir) == "":
        raise DataError(f"no data directory given; {HOW_TO_PROVIDE}")
    data_dir = pathlib.Path(data_dir).expanduser()
    folder = _find_folder(data_dir)
    if not folder.is_dir():
        if not download:
            raise DataError(f"CIFAR-10 not found at {folder} (download disabled); {HOW_TO_PROVIDE}")
        download_cifar10(data_dir, url=url, md5=md5, log=log)

    parts = [read_batch_file(folder / f) for f in TRAIN_FILES]
    test_images, test_labels = read_batch_file(folder / TEST_FILE)
    if subset is not None:
        per_batch, n_test = subset[0] // len(TRAIN_FILES), subset[1]
        short = [(f, len(p[1])) for f, p in zip(TRAIN_FILES, parts) if len(p[1]) < per_batch]
        if short or len(test_labels) < n_test:
            name, n = short[0] if short else (TEST_FILE, len(test_labels))
            raise DataError(f"--subset {subset[0]},{subset[1]}: {folder / name} holds only "
                            f"{n} images, fewer than the subset takes from it")
        parts = [(x[:per_batch], y[:per_batch]) for x, y in parts]
        test_images, test_labels = test_images[:n_test], test_labels[:n_test]
    if (folder / META_FILE).exists():
        _check_meta(folder / META_FILE)
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    if len(labels) < 2:
        raise DataError(f"{folder}: only {len(labels)} training images; need at least 2")
    train_idx, val_idx = split_indices(len(labels), split_seed, val_fraction)
    splits = {
        "train": Split(images[train_idx], labels[train_idx]),
        "val": Split(images[val_idx], labels[val_idx]),
        "test": Split(test_images, test_labels),
    }
    log(f"CIFAR-10 from {folder}: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
    return splits


def check_subset(subset: tuple[int, int]) -> None:
    """DataError unless (n_train, n_test) is a subset CIFAR-10 has: n_train a positive
    multiple of the five training batches, at most 50,000; n_test 1..10,000."""
    n_train, n_test = subset
    if not (0 < n_train <= 50_000 and n_train % len(TRAIN_FILES) == 0 and 0 < n_test <= 10_000):
        raise DataError(f"--subset {n_train},{n_test}: expected TRAIN,TEST with TRAIN a "
                        f"multiple of 5 in 5..50000 and TEST in 1..10000, e.g. 4000,1000")


# --------------------------------------------------------------------------
# Synthetic data and the dataset switch
# --------------------------------------------------------------------------

def synthetic_cifar10(*, n_train: int = 45000, n_val: int = 5000, n_test: int = 10000,
                      seed: int = 0) -> dict[str, Split]:
    """Random uint8 images and labels with CIFAR-10's shapes, deterministic from seed."""
    sizes = {"train": n_train, "val": n_val, "test": n_test}
    for name, n in sizes.items():
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise DataError(f"synthetic {name} size must be a non-negative integer, got {n!r}")
    streams = np.random.SeedSequence(seed).spawn(len(sizes))
    out = {}
    for (name, n), ss in zip(sizes.items(), streams):
        rng = np.random.default_rng(ss)
        out[name] = Split(rng.integers(0, 256, (n, HEIGHT, WIDTH, CHANNELS), dtype=np.uint8),
                          rng.integers(0, NUM_CLASSES, (n,), dtype=np.int32))
    return out


def load_dataset(name: str, data_dir, *, log: Callable[[str], None] = print,
                 **kw) -> dict[str, Split]:
    """``--dataset`` switch: 'cifar10' -> load_cifar10(data_dir, **kw),
    'synthetic' -> synthetic_cifar10(**kw) (data_dir is ignored)."""
    if name == "cifar10":
        return load_cifar10(data_dir, log=log, **kw)
    if name == "synthetic":
        splits = synthetic_cifar10(**kw)
        log("synthetic data: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
        return splits
    raise DataError(f"unknown --dataset {name!r}; choose cifar10 or synthetic")


# --------------------------------------------------------------------------
# Batching (host, numpy)
# --------------------------------------------------------------------------

def steps_per_epoch(n_examples: int, global_batch: int) -> int:
    """Full training batches per epoch (the last partial batch is dropped)."""
    if global_batch <= 0:
        raise DataError(f"global batch must be positive, got {global_batch}")
    return n_examples // global_batch


def epoch_permutation(n: int, *, seed: int, epoch: int) -> np.ndarray:
    """The order of the n training examples in this epoch (reproducible)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def train_batches(split: Split, global_batch: int, *, seed: int, epoch: int,
                  start: int = 0, repeat: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Shuffled global batches (images uint8 NHWC, labels int32); last partial batch dropped.

    `start` skips the epoch's first `start` batches without gathering them: a run resumed
    mid-epoch gets exactly the batches the uninterrupted run would have had.

    `repeat` = R > 1 (`--repeat-aug R`, repeated augmentation): each batch holds m =
    global_batch / R distinct images, R times over, as R consecutive blocks [x_1..x_m,
    x_1..x_m, ...]; every row keeps its own position in the batch (its global example id),
    so each copy draws its own augmentation. The blocks, not adjacent copies, keep the
    mixup / CutMix partners (positions 2k, 2k+1) different images. An epoch keeps its
    number of steps (N // global_batch, the compute of R = 1) and so takes the first
    steps * m images of its permutation: about N/R distinct images, each seen R times (a
    fresh random subset every epoch, as DeiT's RASampler does).
    """
    n = len(split)
    steps = steps_per_epoch(n, global_batch)
    if steps == 0:
        raise DataError(f"global batch {global_batch} is larger than the {n} training "
                        f"images; lower --batch")
    if repeat < 1 or global_batch % repeat:
        raise DataError(f"repeated augmentation: {repeat} copies do not divide the global "
                        f"batch {global_batch}")
    if not 0 <= start <= steps:
        raise DataError(f"start batch {start} is outside the epoch's {steps} batches")
    perm = epoch_permutation(n, seed=seed, epoch=epoch)
    return _gather(split, perm, global_batch, steps, start, repeat)


def _gather(split, perm, b, steps, start=0, repeat=1):
    m = b // repeat  # distinct images per batch
    for s in range(start, steps):
        idx = np.tile(perm[s * m:(s + 1) * m], repeat)
        yield split.images[idx], split.labels[idx]


def eval_batches(split: Split, global_batch: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """In-order batches (images, labels, mask); the last one zero-padded, mask 0 there.

    Every image appears exactly once with mask 1, so sum(mask * correct) counts
    each image once however the batch is split across devices.
    """
    if global_batch <= 0:
        raise DataError(f"global batch must be positive, got {global_batch}")
    return _eval_gen(split, global_batch)


def _eval_gen(split, b):
    n = len(split)
    for start in range(0, n, b):
        images = split.images[start:start + b]
        labels = split.labels[start:start + b]
        k = len(labels)
        mask = np.zeros((b,), np.float32)
        mask[:k] = 1.0
        if k < b:
            images = np.concatenate([images, np.zeros((b - k, *images.shape[1:]), images.dtype)])
            labels = np.concatenate([labels, np.zeros((b - k,), labels.dtype)])
        yield images, labels, mask


def process_slice(x: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """This process's contiguous share of a global batch (leading axis).

    Process i holds rows [i*n/P, (i+1)*n/P); with ``example_ids`` sliced the
    same way, augment gives each row the randomness it has in the global batch.
    """
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise DataError(f"process index {process_index} out of range for {process_count} processes")
    n = x.shape[0]
    if n % process_count:
        raise DataError(f"global batch {n} is not divisible by the {process_count} processes")
    per = n // process_count
    return x[process_index * per:(process_index + 1) * per]
