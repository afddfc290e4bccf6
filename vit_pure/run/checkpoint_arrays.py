"""The array half of the checkpoint format (vit_pure/run/checkpoint.py has the spec):
each pytree leaf's key, its pickle-free encoding (ml_dtypes such as bfloat16 stored as
unsigned ints of the same width), its checksum, and the fsynced ``.npz`` writes and checked
reads. checkpoint.py decides what is written where and when; this module only how one
array goes to and from the file.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import zipfile
from collections.abc import Iterator
from typing import Any

import jax
import ml_dtypes  # a dependency of jax: bfloat16 and the other ml_dtypes
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from vit_pure.errors import CheckpointError, one_line

ARRAYS_FILE = "arrays.npz"
NATIVE_KINDS = "biufc"  # bool, signed, unsigned, float, complex: .npy without pickle


def check_storable(key: str, leaf: Any) -> None:
    """Refuse, before anything is written, a leaf whose dtype has no pickle-free form."""
    if not hasattr(leaf, "dtype"):  # a Python scalar (or something stranger)
        leaf = np.asarray(leaf)
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise CheckpointError(f"{key}: typed PRNG key; save jax.random.key_data(key) instead")
    dtype = np.dtype(leaf.dtype)
    if dtype.kind not in NATIVE_KINDS and not is_ml_dtype(dtype):
        raise CheckpointError(f"{key}: dtype {dtype} cannot be stored without pickle")


def to_host(leaf: Any) -> np.ndarray:
    """The whole leaf as a host numpy array (one device fetch; Python scalars too)."""
    return np.asarray(jax.device_get(leaf))


def encode(array: np.ndarray) -> tuple[np.ndarray, str]:
    """(array as stored in the .npz, real dtype name): the dtypes as checkpoint.py's
    docstring describes them."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    stored = array
    if is_ml_dtype(array.dtype):  # the same bits as an unsigned int of the same width
        stored = array.view(np.dtype(f"uint{8 * array.dtype.itemsize}"))
    return c_order(stored), array.dtype.name


def c_order(array: np.ndarray) -> np.ndarray:
    # (np.ascontiguousarray would turn a 0-d array into shape (1,).)
    return array if array.flags.c_contiguous else array.copy(order="C")


def is_ml_dtype(dtype: np.dtype) -> bool:
    return dtype.type.__module__.split(".")[0] == "ml_dtypes"


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(c_order(array).data).hexdigest()


def write_npz(path: pathlib.Path, arrays: Iterator[tuple[str, np.ndarray]]) -> None:
    """An uncompressed .npz, as ``np.savez`` writes it, then fsync."""
    with open(path, "wb") as f:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for key, array in arrays:
                with zf.open(key + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def write_bytes(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: pathlib.Path) -> None:
    """Make the directory's entries (created / renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_npz(path: pathlib.Path) -> Any:
    try:
        return np.load(path / ARRAYS_FILE, allow_pickle=False)
    except FileNotFoundError:
        raise CheckpointError(f"{ARRAYS_FILE} is missing") from None
    except Exception as e:  # a truncated zip, garbage, ...: all mean "corrupt"
        raise CheckpointError(f"{ARRAYS_FILE} is unreadable: {one_line(e)}") from None


def read_stored(npz: Any, entry: dict[str, Any]) -> np.ndarray:
    """The array of ``entry`` as stored, after checking dtype, shape and checksum."""
    key = entry["key"]
    if key not in npz.files:
        raise CheckpointError(f"{key}: missing from {ARRAYS_FILE}")
    try:
        array = npz[key]
    except Exception as e:  # bad CRC, truncated member, an object array (pickle), ...
        raise CheckpointError(f"{key}: unreadable: {one_line(e)}") from None
    if array.dtype != np.dtype(entry["stored_dtype"]) or list(array.shape) != entry["shape"]:
        raise CheckpointError(
            f"{key}: stored as {array.dtype}{list(array.shape)}, manifest says "
            f"{entry['stored_dtype']}{entry['shape']}"
        )
    if sha256(array) != entry["sha256"]:
        raise CheckpointError(f"{key}: sha256 checksum mismatch")
    return array


def decode(entry: dict[str, Any], stored: np.ndarray) -> np.ndarray:
    """View a stored array as its real dtype (the bits are the same)."""
    if entry["dtype"] == entry["stored_dtype"]:
        return stored
    dtype = getattr(ml_dtypes, entry["dtype"], None)
    if dtype is None or np.dtype(dtype).itemsize != stored.dtype.itemsize:
        raise CheckpointError(f"{entry['key']}: unknown dtype {entry['dtype']!r}")
    return stored.view(dtype)


def flatten(name: str, tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """[(key, leaf)] in pytree order, and the treedef; keys as checkpoint.py's docstring
    describes them."""
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keyed = [(leaf_key(name, path), leaf) for path, leaf in paths_and_leaves]
    seen: set[str] = set()
    for key, _ in keyed:
        if key in seen:
            raise CheckpointError(f"{key}: two leaves of {name!r} have this key")
        seen.add(key)
    return keyed, treedef


def leaf_key(name: str, path: tuple[Any, ...]) -> str:
    parts = [name]
    for entry in path:
        if isinstance(entry, DictKey):
            part = entry.key
        elif isinstance(entry, SequenceKey):
            part = entry.idx
        elif isinstance(entry, GetAttrKey):
            part = entry.name
        elif isinstance(entry, FlattenedIndexKey):
            part = entry.key
        else:
            part = entry
        part = str(part)
        if not part or "/" in part:
            raise CheckpointError(
                f"{'/'.join(parts)}: pytree key {part!r} is empty or contains '/'"
            )
        parts.append(part)
    return "/".join(parts)
