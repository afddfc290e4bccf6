"""vit_pure.run.checkpoint: bitwise round trip, atomic save, corruption, retention, no pickle."""
import errno
import hashlib
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vit_pure.errors import CheckpointError
from vit_pure.run import checkpoint as ckpt
from vit_pure.run import checkpoint_arrays

META = {"config": {"model": "vit-tiny", "dim": 7, "lr": 1e-3}, "note": "test"}


def make_state(seed: int, step: int) -> dict:
    """A realistic training state: bf16 + f32 params, adamw after one update, loss scale, ..."""
    keys = jax.random.split(jax.random.key(seed), 5)
    params = {
        "patch_embed": {
            "kernel": jax.random.normal(keys[0], (12, 7), jnp.bfloat16),
            "bias": jnp.zeros((7,), jnp.float32),
        },
        "blocks": [
            {"attn": {"qkv": {"kernel": jax.random.normal(keys[1], (7, 21))}},
             "ln": {"scale": jnp.ones((7,), jnp.bfloat16)}},
            {"attn": {"qkv": {"kernel": jax.random.normal(keys[2], (7, 21))}},
             "ln": {"scale": jnp.ones((7,), jnp.bfloat16)}},
        ],
        "head": {"kernel": jax.random.normal(keys[3], (7, 5), jnp.float32)},
    }
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jax.random.normal(keys[4], p.shape, p.dtype), params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {
        "params": params,
        "opt_state": opt_state,
        "loss_scale": {"scale": jnp.float32(2.0**15), "good_steps": jnp.int32(3)},
        "step": step,
        "rng": jax.random.key_data(jax.random.key(seed + 100)),
        "data_pos": 128 * step,
    }


def assert_bitwise_equal(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        if isinstance(w, (int, float, bool)):
            assert type(g) is type(w) and g == w, path
            continue
        assert isinstance(g, np.ndarray), path
        w = np.asarray(w)
        assert (g.dtype, g.shape) == (w.dtype, w.shape), path
        assert g.tobytes() == w.tobytes(), path


def shape_template(state):
    """Template of jax.ShapeDtypeStruct leaves (Python scalars stay Python scalars)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, state
    )


def test_round_trip_is_bitwise(tmp_path):
    state = make_state(seed=0, step=5)
    adam = state["opt_state"][0]
    assert int(adam.count) == 1 and float(jnp.abs(adam.mu["head"]["kernel"]).sum()) > 0

    path = ckpt.save(tmp_path, 5, state, META)

    assert path == tmp_path / "step_00000005"
    assert ckpt.read_meta(path) == META
    assert_bitwise_equal(ckpt.restore(path, state), state)
    assert_bitwise_equal(ckpt.restore(path, shape_template(state)), state)
    restored = ckpt.restore(path, shape_template(state))
    assert restored["params"]["patch_embed"]["kernel"].dtype == jnp.bfloat16
    assert type(restored["opt_state"][0]) is optax.ScaleByAdamState

    manifest = json.loads((path / "manifest.json").read_text())
    entries = {e["key"]: e for e in manifest["arrays"]}
    assert entries["params/patch_embed/kernel"]["dtype"] == "bfloat16"
    assert entries["params/patch_embed/kernel"]["stored_dtype"] == "uint16"
    assert entries["opt_state/0/mu/blocks/1/attn/qkv/kernel"]["shape"] == [7, 21]
    assert entries["opt_state/0/count"]["dtype"] == "int32"
    assert entries["rng"]["dtype"] == "uint32"
    assert manifest["step"] == 5 and manifest["version"] == ckpt.VERSION


def test_numpy_only_reading_as_documented(tmp_path):
    """The module docstring's numpy + json recipe, and load_numpy, read the same values."""
    state = make_state(seed=1, step=2)
    path = ckpt.save(tmp_path, 2, state, META)

    with open(path / "manifest.json") as f:
        manifest = json.load(f)
    by_hand = {}
    with np.load(path / "arrays.npz", allow_pickle=False) as npz:
        for e in manifest["arrays"]:
            a = npz[e["key"]]
            assert hashlib.sha256(a.tobytes()).hexdigest() == e["sha256"]
            if e["dtype"] == "bfloat16":
                a = (a.astype(np.uint32) << 16).view(np.float32)
            by_hand[e["key"]] = a

    bf16 = np.asarray(state["params"]["patch_embed"]["kernel"])
    np.testing.assert_array_equal(by_hand["params/patch_embed/kernel"], bf16.astype(np.float32))
    loaded = ckpt.load_numpy(path)
    assert loaded.keys() == by_hand.keys()
    assert loaded["params/patch_embed/kernel"].dtype == jnp.bfloat16
    assert loaded["params/patch_embed/kernel"].tobytes() == bf16.tobytes()
    assert loaded["data_pos"] == 256 and loaded["step"].dtype == np.int64


class SimulatedCrash(BaseException):
    """The process dying mid-save (kill -9, power loss): nothing of the kit's runs after it,
    unlike an OSError, which `save` handles (test_io_error_during_save_is_one_line)."""


@pytest.mark.parametrize("crash_in", ["npz_writer", "rename"])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash_in):
    state1, state2 = make_state(seed=0, step=1), make_state(seed=1, step=2)
    step1 = ckpt.save(tmp_path, 1, state1, META)

    if crash_in == "npz_writer":  # die after two arrays of step 2 are on disk
        real_write_array, calls = np.lib.format.write_array, []

        def write_array(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise SimulatedCrash("simulated crash while writing arrays.npz")
            return real_write_array(*args, **kwargs)

        monkeypatch.setattr(np.lib.format, "write_array", write_array)
    else:  # everything written and fsynced, die just before the rename into place
        real_rename = os.rename

        def rename(src, dst):
            if os.path.basename(src).startswith(".tmp-"):
                raise SimulatedCrash("simulated crash before rename")
            return real_rename(src, dst)

        monkeypatch.setattr(os, "rename", rename)

    with pytest.raises(SimulatedCrash, match="simulated crash"):
        ckpt.save(tmp_path, 2, state2, META)
    monkeypatch.undo()

    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == [f".tmp-step_00000002-{os.getpid()}"]
    assert os.listdir(tmp_path / leftovers[0])  # partial data really was written
    assert ckpt.list_checkpoints(tmp_path) == [step1]
    log = []
    assert ckpt.latest(tmp_path, log=log.append) == step1
    assert log == []
    assert_bitwise_equal(ckpt.restore(step1, state1), state1)

    step2 = ckpt.save(tmp_path, 2, state2, META)  # the next save cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]
    assert_bitwise_equal(ckpt.restore(ckpt.latest(tmp_path), state2), state2)
    assert ckpt.latest(tmp_path) == step2


@pytest.mark.parametrize("errno_, where", [(errno.ENOSPC, "npz"), (errno.EACCES, "manifest"),
                                           (errno.EROFS, "mkdir")])
def test_io_error_during_save_is_one_line(tmp_path, monkeypatch, errno_, where):
    """Disk full, no permission, a read-only file system, injected where the save meets
    them: one CheckpointError line naming the step, the directory and the cause; the
    partial .tmp-* removed; the checkpoint written before still the latest, intact."""
    state1, state2 = make_state(seed=0, step=1), make_state(seed=1, step=2)
    step1 = ckpt.save(tmp_path, 1, state1, META)
    fault = OSError(errno_, os.strerror(errno_))
    if where == "npz":  # after part of arrays.npz is on disk
        real_write_array, calls = np.lib.format.write_array, []

        def write_array(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise fault
            return real_write_array(*args, **kwargs)

        monkeypatch.setattr(np.lib.format, "write_array", write_array)
    elif where == "manifest":
        monkeypatch.setattr(checkpoint_arrays, "write_bytes",
                            lambda path, data: (_ for _ in ()).throw(fault))
    else:
        real_mkdir = pathlib.Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self.name.startswith(".tmp-"):
                raise fault
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)

    with pytest.raises(CheckpointError) as e:
        ckpt.save(tmp_path, 2, state2, META)
    monkeypatch.undo()
    message = str(e.value)
    assert "\n" not in message and "step-2" in message and str(tmp_path) in message
    assert os.strerror(errno_) in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    assert ckpt.latest(tmp_path) == step1
    assert_bitwise_equal(ckpt.restore(step1, state1), state1)


def _flip_byte_in_head_kernel(path, state):
    data = bytearray((path / "arrays.npz").read_bytes())
    raw = np.asarray(state["params"]["head"]["kernel"]).tobytes()
    at = data.find(raw)
    assert at >= 0
    data[at + len(raw) // 2] ^= 0x40
    (path / "arrays.npz").write_bytes(bytes(data))


def _truncate_arrays(path, state):
    with open(path / "arrays.npz", "r+b") as f:
        f.truncate(os.path.getsize(path / "arrays.npz") // 2)


def _rewrite_one_value(path, state):
    """A well-formed npz whose zip CRCs are fine but one array differs: only sha256 sees it."""
    with np.load(path / "arrays.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["params/head/kernel"] = arrays["params/head/kernel"] + 1
    with open(path / "arrays.npz", "wb") as f:
        np.savez(f, **arrays)


CORRUPTIONS = {
    "flipped byte": (_flip_byte_in_head_kernel, ""),
    "truncated arrays": (_truncate_arrays, "arrays.npz"),
    "changed value": (_rewrite_one_value, "params/head/kernel: sha256 checksum mismatch"),
    "deleted manifest": (lambda p, s: (p / "manifest.json").unlink(), "manifest.json is missing"),
    "garbled manifest": (lambda p, s: (p / "manifest.json").write_text("{\"format"), "manifest"),
    "deleted arrays": (lambda p, s: (p / "arrays.npz").unlink(), "arrays.npz is missing"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_latest_skips_corrupt_newest(tmp_path, corruption):
    corrupt, reason = CORRUPTIONS[corruption]
    state1, state2 = make_state(seed=0, step=1), make_state(seed=1, step=2)
    step1 = ckpt.save(tmp_path, 1, state1, META)
    step2 = ckpt.save(tmp_path, 2, state2, META)
    corrupt(step2, state2)

    log = []
    assert ckpt.latest(tmp_path, log=log.append) == step1
    assert len(log) == 1 and "\n" not in log[0]
    assert log[0].startswith(f"skipping corrupt checkpoint {step2}: ")
    assert reason in log[0]
    with pytest.raises(CheckpointError):
        ckpt.verify(step2)
    with pytest.raises(CheckpointError):
        ckpt.restore(step2, state2)
    assert_bitwise_equal(ckpt.restore(step1, state1), state1)

    corrupt(step1, state1)
    log.clear()
    assert ckpt.latest(tmp_path, log=log.append) is None
    assert len(log) == 2


def test_keep_deletes_oldest(tmp_path):
    state = {"w": np.arange(3.0)}
    for step in range(1, 6):
        ckpt.save(tmp_path, step, state, {}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    # Saving an older step while newer ones exist keeps the one just written.
    ckpt.save(tmp_path, 3, state, {}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_00000003", "step_00000004", "step_00000005"]
    ckpt.save(tmp_path, 6, state, {}, keep=None)
    assert len(ckpt.list_checkpoints(tmp_path)) == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_resave_of_same_step_replaces_it(tmp_path):
    path = ckpt.save(tmp_path, 7, {"w": np.zeros(4)}, {"v": 1})
    assert ckpt.save(tmp_path, 7, {"w": np.ones(4)}, {"v": 2}) == path
    assert ckpt.read_meta(path) == {"v": 2}
    np.testing.assert_array_equal(ckpt.restore(path, {"w": np.zeros(4)})["w"], np.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000007"]


def _with_head(state, head):
    params = {**state["params"], "head": head}
    return {**state, "params": params}


MISMATCHES = {
    "shape": (lambda s: _with_head(s, {"kernel": jnp.zeros((5, 7))}),
              "params/head/kernel: shape [7, 5] in the checkpoint, [5, 7] in the template"),
    "dtype": (lambda s: _with_head(s, {"kernel": jnp.zeros((7, 5), jnp.bfloat16)}),
              "params/head/kernel: dtype float32 in the checkpoint, bfloat16 in the template"),
    "missing key": (lambda s: _with_head(s, {**s["params"]["head"], "bias": jnp.zeros(5)}),
                    "params/head/bias is in the template but not in the checkpoint"),
    "extra key": (lambda s: _with_head(s, {}),
                  "params/head/kernel is in the checkpoint but not in the template"),
    "python int": (lambda s: {**s, "loss_scale": {**s["loss_scale"], "scale": 1}},
                   "loss_scale/scale: template is a Python int, checkpoint has float32[]"),
}


@pytest.mark.parametrize("mismatch", list(MISMATCHES))
def test_template_mismatch_names_the_key(tmp_path, mismatch):
    make_template, message = MISMATCHES[mismatch]
    state = make_state(seed=0, step=1)
    path = ckpt.save(tmp_path, 1, state, META)
    with pytest.raises(CheckpointError) as info:
        ckpt.restore(path, make_template(state))
    assert str(info.value) == message


def test_restore_of_a_subset(tmp_path):
    state = make_state(seed=0, step=1)
    path = ckpt.save(tmp_path, 1, state, META)
    restored = ckpt.restore(path, {"params": state["params"], "step": 0})
    assert restored.keys() == {"params", "step"} and restored["step"] == 1
    assert_bitwise_equal(restored["params"], state["params"])


def test_save_refuses_what_it_cannot_store(tmp_path):
    with pytest.raises(CheckpointError, match="key_data"):
        ckpt.save(tmp_path, 1, {"rng": jax.random.key(0)}, {})
    with pytest.raises(CheckpointError, match="text: dtype <U3 cannot be stored"):
        ckpt.save(tmp_path, 1, {"w": np.zeros(2), "text": np.array(["abc"])}, {})
    with pytest.raises(CheckpointError, match="objects: dtype object cannot be stored"):
        ckpt.save(tmp_path, 1, {"w": np.zeros(2), "objects": np.array([None])}, {})
    with pytest.raises(CheckpointError, match="name: dtype <U3 cannot be stored"):
        ckpt.save(tmp_path, 1, {"w": np.zeros(2), "name": "vit"}, {})
    with pytest.raises(CheckpointError, match="opt/0/x: pytree key 'y/z' .* contains '/'"):
        ckpt.save(tmp_path, 1, {"opt": ({"x": {"y/z": np.zeros(2)}},)}, {})
    with pytest.raises(CheckpointError, match="meta is not JSON"):
        ckpt.save(tmp_path, 1, {"w": np.zeros(2)}, {"bad": object()})
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


UNPICKLED = []


def _record_unpickling(tag):
    UNPICKLED.append(tag)
    return tag


class _Trap:
    """Unpickling this object calls _record_unpickling: proof that pickle ran."""

    def __reduce__(self):
        return _record_unpickling, ("trap",)


def test_reading_never_unpickles(tmp_path):
    path = tmp_path / "step_00000001"
    path.mkdir()
    trap = np.empty(1, dtype=object)
    trap[0] = _Trap()
    np.savez(path / "arrays.npz", **{"params/w": trap})
    entry = {"key": "params/w", "dtype": "float32", "stored_dtype": "float32", "shape": [1],
             "sha256": "0" * 64}
    manifest = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "step": 1, "meta": {},
                "arrays": [entry]}
    (path / "manifest.json").write_text(json.dumps(manifest))

    with np.load(path / "arrays.npz", allow_pickle=True) as npz:  # the trap works...
        npz["params/w"]
    assert UNPICKLED == ["trap"]
    UNPICKLED.clear()

    with pytest.raises(CheckpointError, match="params/w: unreadable"):  # ...and is refused
        ckpt.restore(path, {"params": {"w": np.zeros(1, np.float32)}})
    with pytest.raises(CheckpointError, match="params/w: unreadable"):
        ckpt.verify(path)
    with pytest.raises(CheckpointError, match="params/w: unreadable"):
        ckpt.load_numpy(path)
    assert UNPICKLED == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fds")
def test_save_fsyncs_files_then_directories(tmp_path, monkeypatch):
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ckpt.save(tmp_path, 3, {"w": np.zeros(2)}, {})
    tmp = f".tmp-step_00000003-{os.getpid()}"
    assert synced == [f"{tmp}/arrays.npz", f"{tmp}/manifest.json", tmp, "."]


def test_sharded_array_is_saved_whole(tmp_path):
    n = len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    whole = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    sharded = jax.device_put(whole, rows)
    assert len(sharded.addressable_shards) == n
    path = ckpt.save(tmp_path, 1, {"w": sharded}, {})
    np.testing.assert_array_equal(ckpt.restore(path, {"w": sharded})["w"], whole)
