"""Checkpoints: a training state of plain pytrees, saved atomically as ``.npz`` + JSON.

The state is a dict of named pytrees, e.g. ``{"params": ..., "opt_state": ..., "step":
1200, "rng": jax.random.key_data(key)}``. ``save`` writes it (whole arrays, one writer per
directory, atomically: the comment above it), ``latest`` finds the newest intact
checkpoint, ``restore`` rebuilds the pytrees from a template of the same structure (the
caller places them on devices), so a checkpoint resumes on any device count, mesh or
script. Nothing is pickled, so loading never runs code from the file; the format, and how
to open one with numpy and json alone, is docs/checkpoint-format.md. The loop's meta holds
the data position, the step count, the model config, the policy and every flag
(``resume.Checkpoints``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from vit_pure.errors import CheckpointError, one_line
from vit_pure.run import checkpoint_arrays as arrays
from vit_pure.run.checkpoint_arrays import ARRAYS_FILE

FORMAT = "vit_pure.checkpoint"
VERSION = 1
MANIFEST_FILE = "manifest.json"

_STEP_DIR = re.compile(r"step_(\d{8,})")
_TMP_PREFIX = ".tmp-"  # a save in progress, or one that crashed
_TRASH_PREFIX = ".trash-"  # a checkpoint on its way out (retention, or re-save of a step)


def step_dir_name(step: int) -> str:
    """``step_00001200``: the directory name of the checkpoint of ``step``."""
    return f"step_{step:08d}"


# --------------------------------------------------------------------------- writing


# Arrays are stored whole (unsharded), never as per-device shards: ``save`` fetches a sharded
# ``jax.Array`` in full, the loop saves ``strategy.host_state(state)`` and lays a restored
# state out with ``strategy.put_state``. So a checkpoint of ``train_pmap.py`` resumes in
# ``train_shardmap.py`` and back, on another device count, mesh or FSDP setting; the price is
# one host holding the whole state while saving (about 1 GB for vit-b16 with AdamW in
# float32). One writer per ``ckpt_dir``: in a multi-process job only process 0 calls
# ``save``, because ``save`` deletes the temporary directories it finds. Re-saving an
# existing step renames the old directory to ``.trash-*`` and the new one into place; a
# crash between those two renames leaves that step absent (``latest`` then returns the step
# before it), never half written.
def save(
    ckpt_dir: str | os.PathLike,
    step: int,
    state: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    keep: int | None = 3,
) -> pathlib.Path:
    """Write ``state`` (named pytrees) and ``meta`` (a JSON dict) as ``ckpt_dir/step_XXXXXXXX``.

    Atomic: the checkpoint is written and fsynced in a temporary sibling directory, then
    renamed into place; a crash at any point leaves the previous checkpoints intact and at
    most a ``.tmp-*`` directory that readers ignore and the next save deletes. Saving a step
    that exists replaces it. Afterwards only the newest ``keep`` complete checkpoints are
    kept (``keep=None`` keeps all); the one just written is never deleted, even when newer
    ones exist. Returns the checkpoint's path.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep!r}")
    step = int(step)
    # Check everything that can be checked before touching the disk.
    leaves = [kv for name, tree in _checked_items(state) for kv in arrays.flatten(name, tree)[0]]
    for key, leaf in leaves:
        arrays.check_storable(key, leaf)
    try:
        meta_json = json.loads(json.dumps(dict(meta)))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"meta is not JSON-serialisable: {one_line(e)}") from None

    ckpt_dir = pathlib.Path(ckpt_dir)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _delete_stale(ckpt_dir)
        tmp.mkdir()
        _write_checkpoint(tmp, final, ckpt_dir, step, leaves, meta_json)
    except OSError as e:  # disk full, no permission, the directory gone: one line
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a partial save behind
        raise CheckpointError(
            f"cannot write the step-{step} checkpoint in {ckpt_dir} "
            f"({e.strerror or one_line(e)}); the checkpoints written before are intact"
        ) from None

    if keep is not None:
        complete = [p for p in list_checkpoints(ckpt_dir) if (p / MANIFEST_FILE).is_file()]
        for path in complete[:-keep]:
            if path != final:
                _delete_dir(path)
    return final


def _write_checkpoint(tmp: pathlib.Path, final: pathlib.Path, ckpt_dir: pathlib.Path, step: int,
                      leaves: list, meta_json: dict) -> None:
    """`save`'s disk work: write and fsync `tmp`, then rename it to `final`."""
    # Arrays are fetched to host one at a time while they are written, so at most one
    # leaf's host copy exists at once.
    entries: list[dict[str, Any]] = []

    def stored_arrays() -> Iterator[tuple[str, np.ndarray]]:
        for key, leaf in leaves:
            stored, dtype_name = arrays.encode(arrays.to_host(leaf))
            entries.append(
                {
                    "key": key,
                    "dtype": dtype_name,
                    "stored_dtype": stored.dtype.name,
                    "shape": list(stored.shape),
                    "sha256": arrays.sha256(stored),
                }
            )
            yield key, stored

    arrays.write_npz(tmp / ARRAYS_FILE, stored_arrays())
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "meta": meta_json,
                "arrays": entries}
    arrays.write_bytes(tmp / MANIFEST_FILE, _manifest_text(manifest).encode())
    arrays.fsync_dir(tmp)

    if final.exists():  # re-save of the same step: move the old one away, then swap in
        old = ckpt_dir / f"{_TRASH_PREFIX}{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        arrays.fsync_dir(ckpt_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
        arrays.fsync_dir(ckpt_dir)


def _checked_items(state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    for name in state:
        if not isinstance(name, str) or not name or "/" in name:
            raise CheckpointError(f"state name {name!r} must be a non-empty str without '/'")
    return list(state.items())


def _manifest_text(manifest: dict[str, Any]) -> str:
    """JSON with one line per field and one line per array entry, for people reading it."""
    fields = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in manifest.items() if k != "arrays"]
    entries = ",\n  ".join(json.dumps(entry) for entry in manifest["arrays"])
    return "{\n" + ",\n".join(fields) + ',\n "arrays": [\n  ' + entries + "\n ]\n}\n"


def _delete_dir(path: pathlib.Path) -> None:
    """Rename out of the ``step_*`` namespace first, so no reader sees it half deleted."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash)


def _delete_stale(ckpt_dir: pathlib.Path) -> None:
    """Delete what crashed saves and deletions left behind."""
    for path in ckpt_dir.iterdir():
        if path.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) and path.is_dir():
            shutil.rmtree(path)


# --------------------------------------------------------------------------- finding


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[pathlib.Path]:
    """Every ``step_*`` directory in ``ckpt_dir``, oldest step first (not verified)."""
    ckpt_dir = pathlib.Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for path in ckpt_dir.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and path.name == step_dir_name(int(match[1])) and path.is_dir():
            found.append((int(match[1]), path))
    return [path for _, path in sorted(found)]


def step_of(path: str | os.PathLike) -> int:
    """The step of a checkpoint directory, from its name (``step_00001200`` -> 1200)."""
    match = _STEP_DIR.fullmatch(pathlib.Path(path).name)
    if not match:
        raise CheckpointError(f"{path}: not a checkpoint directory (step_NNNNNNNN)")
    return int(match[1])


def latest(
    ckpt_dir: str | os.PathLike, *, log: Callable[[str], Any] = print
) -> pathlib.Path | None:
    """The newest checkpoint that passes ``verify``, or None.

    Each newer checkpoint that fails is reported with one ``log`` line and skipped.
    Verifying reads and hashes every array of the checkpoint it returns, so a resume reads
    it twice (here and in ``restore``); checkpoints of this kit are small enough for that.
    """
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            verify(path)
        except CheckpointError as e:
            log(f"skipping corrupt checkpoint {path}: {e}")
            continue
        return path
    return None


# --------------------------------------------------------------------------- reading


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``meta`` dict that was passed to ``save``."""
    return _read_manifest(pathlib.Path(path))["meta"]


def verify(path: str | os.PathLike) -> None:
    """Raise CheckpointError unless the manifest and every array in it are intact."""
    path = pathlib.Path(path)
    manifest = _read_manifest(path)
    with arrays.open_npz(path) as npz:
        listed = {e["key"] for e in manifest["arrays"]}
        extra = sorted(set(npz.files) - listed)
        if extra:
            raise CheckpointError(f"{extra[0]}: in {ARRAYS_FILE} but not in {MANIFEST_FILE}")
        for entry in manifest["arrays"]:
            arrays.read_stored(npz, entry)


def load_numpy(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All arrays by key, checksum-verified, in their real dtypes (bfloat16 via ml_dtypes).

    Needs no template and touches no device: the arrays come back as numpy arrays
    (bfloat16 through ml_dtypes), to inspect a checkpoint or to convert it.
    """
    path = pathlib.Path(path)
    manifest = _read_manifest(path)
    with arrays.open_npz(path) as npz:
        return {e["key"]: arrays.decode(e, arrays.read_stored(npz, e)) for e in manifest["arrays"]}


def restore(path: str | os.PathLike, template: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild the pytrees named in ``template`` from the checkpoint at ``path``.

    ``template`` has the structure to rebuild: each leaf is an array or a
    ``jax.ShapeDtypeStruct`` (its shape and dtype must match the checkpoint) or a Python
    scalar (restored as a Python scalar of the same type). Within each named pytree the
    keys must match exactly; state entries the template does not name are not read, so
    ``restore(path, {"params": ...})`` loads just the parameters. Returns numpy arrays,
    checksum-verified. Any mismatch raises CheckpointError naming the key.
    """
    path = pathlib.Path(path)
    manifest = _read_manifest(path)
    entries = {e["key"]: e for e in manifest["arrays"]}
    restored = {}
    with arrays.open_npz(path) as npz:
        for name, tree in _checked_items(template):
            keyed, treedef = arrays.flatten(name, tree)
            wanted = {key for key, _ in keyed}
            present = {key for key in entries if key == name or key.startswith(name + "/")}
            _require_none(sorted(wanted - present), "is in the template but not in the checkpoint")
            _require_none(sorted(present - wanted), "is in the checkpoint but not in the template")
            values = [_restore_leaf(key, like, entries[key], npz) for key, like in keyed]
            restored[name] = jax.tree_util.tree_unflatten(treedef, values)
    return restored


def _require_none(keys: list[str], problem: str) -> None:
    if keys:
        more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
        raise CheckpointError(f"{keys[0]} {problem}{more}")


def _restore_leaf(key: str, like: Any, entry: dict[str, Any], npz: Any) -> Any:
    shape, dtype_name = tuple(entry["shape"]), entry["dtype"]
    if isinstance(like, (bool, int, float)):  # a Python scalar such as `step: int`
        kinds = "b" if isinstance(like, bool) else "iu" if isinstance(like, int) else "f"
        if shape != () or np.dtype(entry["stored_dtype"]).kind not in kinds:
            raise CheckpointError(
                f"{key}: template is a Python {type(like).__name__}, checkpoint has "
                f"{dtype_name}{list(shape)}"
            )
        return type(like)(arrays.read_stored(npz, entry).item())
    try:
        like_shape, like_dtype = tuple(like.shape), np.dtype(like.dtype)
    except (AttributeError, TypeError) as e:
        raise CheckpointError(
            f"{key}: template leaf {type(like).__name__} needs a shape and a numpy dtype "
            f"({one_line(e)})"
        ) from None
    if like_shape != shape:
        raise CheckpointError(
            f"{key}: shape {list(shape)} in the checkpoint, {list(like_shape)} in the template"
        )
    if like_dtype.name != dtype_name:
        raise CheckpointError(
            f"{key}: dtype {dtype_name} in the checkpoint, {like_dtype.name} in the template"
        )
    return arrays.decode(entry, arrays.read_stored(npz, entry))


def _read_manifest(path: pathlib.Path) -> dict[str, Any]:
    """The parsed manifest, checked for the fields every reader relies on."""
    file = path / MANIFEST_FILE
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{MANIFEST_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{MANIFEST_FILE} is unreadable: {one_line(e)}") from None
    try:
        if manifest["format"] != FORMAT or manifest["version"] != VERSION:
            raise CheckpointError(
                f"{MANIFEST_FILE}: format {manifest['format']!r} version "
                f"{manifest['version']!r}, expected {FORMAT!r} version {VERSION}"
            )
        if not isinstance(manifest["step"], int) or not isinstance(manifest["meta"], dict):
            raise ValueError("'step' must be an int and 'meta' a dict")
        for e in manifest["arrays"]:
            np.dtype(e["stored_dtype"])
            if not (
                all(isinstance(e[field], str) for field in ("key", "dtype", "sha256"))
                and isinstance(e["shape"], list)
                and all(isinstance(n, int) for n in e["shape"])
            ):
                raise ValueError(f"bad entry for {e.get('key')!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{MANIFEST_FILE} is malformed: {one_line(e)}") from None
    return manifest


