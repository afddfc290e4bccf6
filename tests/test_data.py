"""vit_pure/data/cifar10.py (loading, splits, batching), vit_pure/data/augment.py (flip + crop) and
vit_pure/data/download.py."""
import functools
import hashlib
import http.server
import io
import os
import pickle
import socket
import tarfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from vit_pure.data import augment as A
from vit_pure.data import cifar10 as D
from vit_pure.data import download as DL

# ---------------------------------------------------------------- helpers


def write_batch(path, images, labels, protocol=2):
    """Write one batch file the way the official ones look (bytes keys, channel-major rows)."""
    rows = np.ascontiguousarray(images.transpose(0, 3, 1, 2)).reshape(len(images), -1)
    d = {b"batch_label": b"a test batch", b"labels": [int(v) for v in labels], b"data": rows}
    path.write_bytes(pickle.dumps(d, protocol=protocol))


def make_folder(root, n_per_batch=6, n_test=6, seed=0):
    """A tiny, valid cifar-10-batches-py under root.

    Returns (train images, labels, test images, labels)."""
    rng = np.random.default_rng(seed)
    folder = root / D.FOLDER
    folder.mkdir(parents=True)
    train_x, train_y = [], []
    for name in D.TRAIN_FILES:
        x = rng.integers(0, 256, (n_per_batch, 32, 32, 3), dtype=np.uint8)
        y = rng.integers(0, 10, (n_per_batch,))
        write_batch(folder / name, x, y)
        train_x.append(x)
        train_y.append(y)
    tx = rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8)
    ty = rng.integers(0, 10, (n_test,))
    write_batch(folder / D.TEST_FILE, tx, ty)
    (folder / D.META_FILE).write_bytes(pickle.dumps(
        {b"label_names": [c.encode() for c in D.CIFAR10_CLASSES], b"num_vis": 3072}, protocol=2))
    return np.concatenate(train_x), np.concatenate(train_y), tx, ty


def make_archive(tmp_path, name="cifar-10-python.tar.gz", **kw):
    """Build a small tar.gz holding cifar-10-batches-py/; returns (archive path, md5, contents)."""
    src = tmp_path / "archive-src"
    contents = make_folder(src, **kw)
    archive = tmp_path / "served" / name
    archive.parent.mkdir(exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / D.FOLDER, arcname=D.FOLDER)
    return archive, hashlib.md5(archive.read_bytes()).hexdigest(), contents


@pytest.fixture()
def http_server(tmp_path):
    """A local HTTP server on 127.0.0.1 serving tmp_path/served; yields (base url, request log)."""
    served = tmp_path / "served"
    served.mkdir(exist_ok=True)
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output quiet
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def index_split(n):
    """A Split whose image i encodes i in its first two bytes, label i % 10."""
    images = np.zeros((n, 32, 32, 3), np.uint8)
    images[:, 0, 0, 0] = np.arange(n) % 256
    images[:, 0, 0, 1] = np.arange(n) // 256
    return D.Split(images, (np.arange(n) % 10).astype(np.int32))


def decode_ids(images):
    return images[:, 0, 0, 0].astype(np.int64) + 256 * images[:, 0, 0, 1].astype(np.int64)


def assert_one_line_error(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg


# ---------------------------------------------------------------- the real subset


@pytest.fixture(scope="module")
def subset(subset_dir):
    lines = []
    splits = D.load_cifar10(subset_dir, download=False, log=lines.append)
    return splits, lines


def test_subset_counts_and_labels(subset):
    splits, lines = subset
    assert {k: len(v) for k, v in splits.items()} == {"train": 3600, "val": 400, "test": 1000}
    for s in splits.values():
        assert s.images.dtype == np.uint8 and s.images.shape[1:] == (32, 32, 3)
        assert s.labels.dtype == np.int32
        assert s.labels.min() == 0 and s.labels.max() == 9
        assert len(np.unique(s.labels)) == 10
    assert any("train 3600, val 400, test 1000" in line for line in lines)


def test_subset_splits_are_disjoint_and_complete(subset, subset_dir):
    splits, _ = subset
    # Read the trusted files with plain pickle, independently of the loader.
    folder = subset_dir / D.FOLDER
    raw = [pickle.loads((folder / f).read_bytes(), encoding="latin1") for f in D.TRAIN_FILES]
    raw_rows = np.concatenate([r["data"] for r in raw])
    raw_images = raw_rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    train = {im.tobytes() for im in splits["train"].images}
    val = {im.tobytes() for im in splits["val"].images}
    assert len(train) == 3600 and len(val) == 400 and not train & val
    assert train | val == {im.tobytes() for im in raw_images}
    # Labels travel with their images (through the split permutation).
    raw_labels = np.concatenate([r["labels"] for r in raw])
    label_of = {im.tobytes(): y for im, y in zip(raw_images, raw_labels)}
    val = splits["val"]
    assert all(label_of[im.tobytes()] == y for im, y in zip(val.images, val.labels))
    # Test split: same order as the file, channel-major rows turned into NHWC.
    test_raw = pickle.loads((folder / D.TEST_FILE).read_bytes(), encoding="latin1")
    np.testing.assert_array_equal(splits["test"].labels, test_raw["labels"])
    r, g, b = test_raw["data"][5].reshape(3, 32, 32)
    np.testing.assert_array_equal(splits["test"].images[5], np.stack([r, g, b], axis=-1))


def test_split_indices_ratio_and_seed():
    tr, va = D.split_indices(50000, 0)
    assert len(tr) == 45000 and len(va) == 5000
    tr, va = D.split_indices(4000, 0)
    tr1, va1 = D.split_indices(4000, 1)
    assert len(va) == 400 and not np.intersect1d(tr, va).size
    np.testing.assert_array_equal(np.sort(np.concatenate([tr, va])), np.arange(4000))
    np.testing.assert_array_equal(va, D.split_indices(4000, 0)[1])
    assert not np.array_equal(va, va1)


def test_val_fraction_moves_images_between_train_and_val(subset_dir):
    """--val-fraction: 0 trains on every training image (no validation); another
    fraction holds out that share; the test split never changes."""
    tr, va = D.split_indices(4000, 0, val_fraction=0.0)
    assert len(va) == 0
    np.testing.assert_array_equal(tr, np.arange(4000))
    assert len(D.split_indices(4000, 0, val_fraction=0.2)[1]) == 800
    lines = []
    splits = D.load_cifar10(subset_dir, download=False, val_fraction=0.0, log=lines.append)
    assert {k: len(v) for k, v in splits.items()} == {"train": 4000, "val": 0, "test": 1000}
    assert any("train 4000, val 0, test 1000" in line for line in lines)


def test_normalization_statistics(subset):
    """The step's own normalisation (step.prepare_images, no augmentation)."""
    from vit_pure.step import prepare_images

    def normalize(x):
        ids = jnp.arange(x.shape[0], dtype=jnp.int32)
        return prepare_images(x, jax.random.key(0), ids, train=False, image_size=x.shape[1])

    splits, _ = subset
    z = np.asarray(jax.jit(normalize)(splits["train"].images))
    assert z.dtype == np.float32
    mean, std = z.mean(axis=(0, 1, 2)), z.std(axis=(0, 1, 2))
    assert np.all(np.abs(mean) < 0.1), mean
    # The conventional CIFAR-10 stds are mean per-image stds, smaller than the pixel std,
    # so normalised pixels have std ~1.2-1.3 on real data.
    assert np.all((std > 0.9) & (std < 1.4)), std
    white = np.asarray(normalize(jnp.full((1, 1, 1, 3), 255, jnp.uint8)))[0, 0, 0]
    expected = (1.0 - np.array(D.CIFAR10_MEAN)) / np.array(D.CIFAR10_STD)
    np.testing.assert_allclose(white, expected, rtol=1e-6)


def test_eval_batches_visit_each_image_once(subset):
    val = subset[0]["val"]
    batches = list(D.eval_batches(val, 96))
    assert len(batches) == 5
    images, labels, masks = (np.concatenate(p) for p in zip(*batches))
    assert all(b[0].shape == (96, 32, 32, 3) and b[2].dtype == np.float32 for b in batches)
    assert masks.sum() == len(val) == 400
    keep = masks == 1
    np.testing.assert_array_equal(labels[keep], val.labels)
    np.testing.assert_array_equal(images[keep], val.images)
    assert not images[~keep].any() and not labels[~keep].any()


def test_train_batches_on_subset(subset):
    train = subset[0]["train"]
    batches = list(D.train_batches(train, 512, seed=0, epoch=0))
    assert len(batches) == D.steps_per_epoch(3600, 512) == 7
    assert all(x.shape == (512, 32, 32, 3) and y.shape == (512,) for x, y in batches)


# ---------------------------------------------------------------- batching


def test_train_batches_shuffle_and_drop_last():
    split = index_split(1000)
    def ids(seed, epoch):
        return [decode_ids(x) for x, _ in D.train_batches(split, 96, seed=seed, epoch=epoch)]
    e0 = ids(0, 0)
    assert len(e0) == D.steps_per_epoch(1000, 96) == 10
    flat = np.concatenate(e0)
    assert len(flat) == 960 and len(np.unique(flat)) == 960 and flat.max() < 1000
    # labels stay with their images
    x, y = next(iter(D.train_batches(split, 96, seed=0, epoch=0)))
    np.testing.assert_array_equal(y, decode_ids(x) % 10)
    # reproducible from (seed, epoch), different across epochs and seeds
    np.testing.assert_array_equal(flat, np.concatenate(ids(0, 0)))
    assert not np.array_equal(flat, np.concatenate(ids(0, 1)))
    assert not np.array_equal(flat, np.concatenate(ids(1, 0)))
    with pytest.raises(D.DataError) as e:
        D.train_batches(split, 2000, seed=0, epoch=0)
    assert_one_line_error(e, "2000", "--batch")


def test_process_slice():
    x = np.arange(24).reshape(12, 2)
    parts = [D.process_slice(x, i, 3) for i in range(3)]
    assert all(p.shape == (4, 2) for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), x)
    with pytest.raises(D.DataError):
        D.process_slice(x, 0, 5)
    with pytest.raises(D.DataError):
        D.process_slice(x, 3, 3)


def test_synthetic_and_load_dataset():
    a = D.synthetic_cifar10(n_train=50, n_val=7, n_test=11, seed=3)
    b = D.load_dataset("synthetic", None, log=lambda s: None,
                       n_train=50, n_val=7, n_test=11, seed=3)
    c = D.synthetic_cifar10(n_train=50, n_val=7, n_test=11, seed=4)
    assert {k: len(v) for k, v in a.items()} == {"train": 50, "val": 7, "test": 11}
    for k in a:
        assert a[k].images.dtype == np.uint8 and a[k].images.shape[1:] == (32, 32, 3)
        assert a[k].labels.dtype == np.int32 and 0 <= a[k].labels.min() and a[k].labels.max() <= 9
        np.testing.assert_array_equal(a[k].images, b[k].images)
        np.testing.assert_array_equal(a[k].labels, b[k].labels)
        assert not np.array_equal(a[k].images, c[k].images)
    assert not np.array_equal(a["train"].images[:7], a["val"].images)
    with pytest.raises(D.DataError) as e:
        D.load_dataset("imagenet", None)
    assert_one_line_error(e, "--dataset", "imagenet")
    with pytest.raises(D.DataError):
        D.synthetic_cifar10(n_train=-1)


# ---------------------------------------------------------------- augmentation


def _images(n, seed=0):
    return jax.random.normal(jax.random.key(seed), (n, 32, 32, 3), jnp.float32)


def test_augment_reproducible_and_random():
    x = _images(8)
    ids = jnp.arange(8, dtype=jnp.int32)
    aug = jax.jit(A.augment)
    out = aug(A.augment_key(0, 0, 0), x, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_array_equal(out, aug(A.augment_key(0, 0, 0), x, ids))
    other = aug(A.augment_key(0, 0, 1), x, ids)
    assert not np.allclose(out, other)
    # every example changed, and each output pixel is a convex mix of the input's pixels
    assert all(not np.allclose(out[i], x[i]) for i in range(8))
    lo, hi = x.min(axis=(1, 2, 3)), x.max(axis=(1, 2, 3))
    assert np.all(out.min(axis=(1, 2, 3)) >= lo - 1e-5)
    assert np.all(out.max(axis=(1, 2, 3)) <= hi + 1e-5)
    # the examples do not all get the same transform
    assert len({tuple(np.round(A.crop_params(k, 32, 32)[0:4], 4).tolist())
                for k in jax.vmap(jax.random.fold_in, (None, 0))(A.augment_key(0, 0, 0), ids)}) == 8
    # bfloat16 in, bfloat16 out
    assert aug(A.augment_key(0, 0, 0), x.astype(jnp.bfloat16), ids).dtype == jnp.bfloat16


def test_augment_key_chain():
    keys = {(s, e, t): jax.random.key_data(A.augment_key(s, e, t)).tolist()
            for s in (0, 1) for e in (0, 1) for t in (0, 1)}
    assert len({str(v) for v in keys.values()}) == 8
    assert jax.random.key_data(A.augment_key(1, 0, 1)).tolist() == keys[(1, 0, 1)]


def test_augment_independent_of_batch_split():
    x = _images(8, seed=1)
    ids = jnp.arange(100, 108, dtype=jnp.int32)   # global positions, e.g. on process 1
    key = A.augment_key(5, 2, 7)
    aug = jax.jit(A.augment)
    full = aug(key, x, ids)
    halves = jnp.concatenate([aug(key, x[:4], ids[:4]), aug(key, x[4:], ids[4:])])
    np.testing.assert_allclose(full, halves, atol=1e-6)
    reversed_order = aug(key, x[::-1], ids[::-1])[::-1]
    np.testing.assert_allclose(full, reversed_order, atol=1e-6)
    # Under shard_map over 8 devices, each device augments its own example.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.jit(jax.shard_map(A.augment, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                    out_specs=P("data")))(key, x, ids)
    np.testing.assert_allclose(full, sharded, atol=1e-6)


def test_crop_params_ranges():
    keys = jax.vmap(jax.random.fold_in, (None, 0))(A.augment_key(0, 0, 0), jnp.arange(512))
    params = jax.vmap(lambda k: A.crop_params(k, 32, 32))(keys)
    top, left, h, w, flip = (np.asarray(a) for a in params)
    area = h * w / 32**2
    assert np.all((area >= 0.9 - 1e-5) & (area <= 1.0 + 1e-5))
    assert np.all((w / h >= 0.9 - 1e-5) & (w / h <= 1.1 + 1e-5))
    assert np.all((top >= 0) & (left >= 0) & (top + h <= 32 + 1e-4) & (left + w <= 32 + 1e-4))
    assert 0.4 < flip.mean() < 0.6
    assert area.min() < 0.92 and area.max() > 0.98  # the whole range is used


def test_crop_flip_resize_is_bilinear():
    x = np.asarray(_images(1, seed=2)[0])
    same = A.crop_flip_resize(x, 0.0, 0.0, 32.0, 32.0, False)
    np.testing.assert_allclose(same, x, atol=1e-6)
    mirrored = A.crop_flip_resize(x, 0.0, 0.0, 32.0, 32.0, True)
    np.testing.assert_allclose(mirrored, x[:, ::-1], atol=1e-6)
    # A linear ramp stays linear: crop columns [8, 24) -> slope 1/2 from 7.75 to 23.25.
    ramp = np.broadcast_to(np.arange(32, dtype=np.float32)[None, :, None], (32, 32, 3))
    out = np.asarray(A.crop_flip_resize(jnp.asarray(ramp), 0.0, 8.0, 32.0, 16.0, False))
    np.testing.assert_allclose(out[5, :, 1], 8 + (np.arange(32) + 0.5) * 0.5 - 0.5, atol=1e-5)
    np.testing.assert_allclose(out[:, 3, 0], out[0, 3, 0])  # rows untouched


# ---------------------------------------------------------------- restricted unpickler


class _RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Evals:
    def __reduce__(self):
        return (eval, ("__import__('os').getcwd()",))


def test_restricted_unpickler_refuses_code(tmp_path):
    make_folder(tmp_path)
    marker = tmp_path / "pwned"
    bad = tmp_path / D.FOLDER / "data_batch_2"
    bad.write_bytes(pickle.dumps({b"data": _RunsShell(marker), b"labels": []}, protocol=2))
    with pytest.raises(D.DataError) as e:
        D.load_cifar10(tmp_path, download=False, log=lambda s: None)
    assert_one_line_error(e, "data_batch_2", "system", "refused")
    assert not marker.exists()
    evil = tmp_path / "evil"
    evil.write_bytes(pickle.dumps(_Evals(), protocol=4))
    with pytest.raises(D.DataError) as e:
        D.restricted_load(evil)
    assert_one_line_error(e, "builtins.eval", "refused")


def test_restricted_unpickler_accepts_other_protocols(tmp_path):
    x = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 32, 32, 3)
    for protocol in (2, 4, 5):
        write_batch(tmp_path / f"b{protocol}", x, [3, 9], protocol=protocol)
        images, labels = D.read_batch_file(tmp_path / f"b{protocol}")
        np.testing.assert_array_equal(images, x)
        np.testing.assert_array_equal(labels, [3, 9])


# ---------------------------------------------------------------- bad input


def _corrupt_missing(f):
    f.unlink()


def _corrupt_truncated(f):
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])


def _corrupt_shape(f):
    f.write_bytes(pickle.dumps({b"data": np.zeros((6, 3000), np.uint8), b"labels": [0] * 6}))


def _corrupt_label_range(f):
    write_batch(f, np.zeros((6, 32, 32, 3), np.uint8), [0, 1, 2, 10, 4, 5])


def _corrupt_label_count(f):
    write_batch(f, np.zeros((6, 32, 32, 3), np.uint8), [0, 1, 2])


def _corrupt_not_a_dict(f):
    f.write_bytes(pickle.dumps([1, 2, 3]))


@pytest.mark.parametrize("corrupt, needle", [
    (_corrupt_missing, "missing"), (_corrupt_truncated, "truncated"),
    (_corrupt_shape, "3072"), (_corrupt_label_range, "label 10 out of range"),
    (_corrupt_label_count, "one per image"), (_corrupt_not_a_dict, "expected a dict"),
])
def test_bad_files_give_one_clear_error(tmp_path, corrupt, needle):
    make_folder(tmp_path)
    corrupt(tmp_path / D.FOLDER / "data_batch_3")
    with pytest.raises(D.DataError) as e:
        D.load_cifar10(tmp_path, download=False, log=lambda s: None)
    assert_one_line_error(e, "data_batch_3", needle)


def test_missing_folder_without_download(tmp_path):
    with pytest.raises(D.DataError) as e:
        D.load_cifar10(tmp_path / "nowhere", download=False)
    assert_one_line_error(e, "--data-dir", "torchvision", "--dataset synthetic")
    with pytest.raises(D.DataError) as e:
        D.load_dataset("cifar10", None)
    assert_one_line_error(e, "--data-dir")


# ---------------------------------------------------------------- download


def test_download_from_local_server(tmp_path, http_server):
    base, requests = http_server
    _, md5, (train_x, train_y, test_x, test_y) = make_archive(tmp_path)
    data_dir = tmp_path / "data"
    lines = []
    splits = D.load_cifar10(data_dir, url=f"{base}/cifar-10-python.tar.gz", md5=md5,
                            log=lines.append)
    assert {k: len(v) for k, v in splits.items()} == {"train": 27, "val": 3, "test": 6}
    np.testing.assert_array_equal(splits["test"].images, test_x)
    np.testing.assert_array_equal(splits["test"].labels, test_y)
    tr, va = D.split_indices(30, 0)
    np.testing.assert_array_equal(splits["val"].images, train_x[va])
    np.testing.assert_array_equal(splits["train"].labels, train_y[tr])
    text = "\n".join(lines)
    assert "downloading" in text and f"md5 ok ({md5})" in text and "ready" in text
    assert sorted(p.name for p in data_dir.iterdir()) == [D.FOLDER]  # nothing left behind
    assert requests == ["/cifar-10-python.tar.gz"]
    # second run reads the folder and does not download again
    D.load_cifar10(data_dir, url=f"{base}/cifar-10-python.tar.gz", md5=md5, log=lines.append)
    assert len(requests) == 1


def test_download_url_from_environment(tmp_path, http_server, monkeypatch):
    base, requests = http_server
    _, md5, _ = make_archive(tmp_path, name="mirror.tgz", n_per_batch=2, n_test=2)
    monkeypatch.setenv(DL.URL_ENV, f"{base}/mirror.tgz")
    monkeypatch.setenv(DL.MD5_ENV, md5)
    splits = D.load_dataset("cifar10", tmp_path / "data", log=lambda s: None)
    assert len(splits["test"]) == 2 and requests == ["/mirror.tgz"]


def test_download_md5_mismatch_keeps_nothing(tmp_path, http_server):
    base, _ = http_server
    _, md5, _ = make_archive(tmp_path)
    data_dir = tmp_path / "data"
    with pytest.raises(D.DataError) as e:
        D.load_cifar10(data_dir, url=f"{base}/cifar-10-python.tar.gz", md5="0" * 32,
                       log=lambda s: None)
    assert_one_line_error(e, "md5 mismatch", md5, "0" * 32)
    assert not data_dir.exists()  # not even the folder it created


def test_download_incomplete_archive_keeps_nothing(tmp_path, http_server):
    base, _ = http_server
    archive, _, _ = make_archive(tmp_path)
    # rebuild the archive without test_batch
    with tarfile.open(archive) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()
                   if not m.name.endswith(D.TEST_FILE)]
    with tarfile.open(archive, "w:gz") as tar:
        for m, content in members:
            tar.addfile(m, io.BytesIO(content) if content is not None else None)
    data_dir = tmp_path / "data"
    with pytest.raises(D.DataError) as e:
        D.load_cifar10(data_dir, url=f"{base}/cifar-10-python.tar.gz",
                       md5=hashlib.md5(archive.read_bytes()).hexdigest(), log=lambda s: None)
    assert_one_line_error(e, "test_batch")
    assert not data_dir.exists()


def test_download_unreachable_fails_fast(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/cifar-10-python.tar.gz"
    data_dir = tmp_path / "data"
    lines = []
    t0 = time.monotonic()
    with pytest.raises(D.DataError) as e:
        D.load_cifar10(data_dir, url=url, log=lines.append)
    assert time.monotonic() - t0 < 5
    assert_one_line_error(e, url, "without a network", "--data-dir",
                          "torchvision.datasets.CIFAR10", "--dataset synthetic")
    assert lines == []  # the error is the only line: nothing was downloading
    assert not data_dir.exists()


def test_download_silent_server_times_out(tmp_path, monkeypatch):
    """A server that accepts the connection but never answers: the socket timeout ends it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    monkeypatch.setattr(DL, "NET_TIMEOUT_S", 0.5)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/cifar-10-python.tar.gz"
    try:
        t0 = time.monotonic()
        with pytest.raises(D.DataError) as e:
            D.load_cifar10(tmp_path / "data", url=url, log=lambda s: None)
        assert time.monotonic() - t0 < 3
    finally:
        listener.close()
    assert_one_line_error(e, "timed out", "--data-dir", "--dataset synthetic")
    assert not (tmp_path / "data").exists()


def test_download_into_an_existing_folder_that_fails_keeps_the_folder(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "mine.txt").write_text("kept")
    with pytest.raises(D.DataError):
        D.load_cifar10(data_dir, url=(tmp_path / "absent.tar.gz").as_uri(), log=lambda s: None)
    assert [p.name for p in data_dir.iterdir()] == ["mine.txt"]


def test_subset_takes_the_first_images_of_each_batch(tmp_path):
    train_x, train_y, test_x, test_y = make_folder(tmp_path, n_per_batch=6, n_test=6)
    splits = D.load_cifar10(tmp_path, download=False, subset=(10, 4), log=lambda s: None)
    first_two = np.concatenate([np.arange(i * 6, i * 6 + 2) for i in range(5)])
    tr, va = D.split_indices(10, 0)
    np.testing.assert_array_equal(splits["train"].images, train_x[first_two][tr])
    np.testing.assert_array_equal(splits["val"].labels, train_y[first_two][va])
    np.testing.assert_array_equal(splits["test"].images, test_x[:4])
    with pytest.raises(D.DataError) as e:  # more than the folder holds
        D.load_cifar10(tmp_path, download=False, subset=(35, 4), log=lambda s: None)
    assert_one_line_error(e, "--subset 35,4", "data_batch_1 holds only 6 images")
    for bad in ((12, 4), (0, 4), (10, 0), (50_005, 4), (10, 10_001)):
        with pytest.raises(D.DataError) as e:
            D.check_subset(bad)
        assert_one_line_error(e, "multiple of 5")


def test_subset_of_the_subset_folder_is_the_folder(subset_dir):
    """--subset 4000,1000 (the cpu-quick recipe's) read from the full CIFAR-10 is the
    shared subset folder: the first 800 images of each training batch, the first 1,000 of
    the test batch; read from that folder it changes nothing."""
    whole = D.load_cifar10(subset_dir, download=False, log=lambda s: None)
    taken = D.load_cifar10(subset_dir, download=False, subset=(4000, 1000), log=lambda s: None)
    for name in whole:
        np.testing.assert_array_equal(whole[name].images, taken[name].images)
        np.testing.assert_array_equal(whole[name].labels, taken[name].labels)


def test_cpu_recipe_from_a_bare_clone_downloads_once(tmp_path, http_server, monkeypatch,
                                                     capsys):
    """README's CPU command with only the clone and a network (a local server stands in):
    --recipe cpu-quick downloads CIFAR-10 into --data-dir and trains on all of the recipe's
    subset (made smaller here, and the model tiny, to fit a test); a second run downloads
    nothing."""
    import train_shardmap
    from vit_pure.run import cli

    base, requests = http_server
    _, md5, _ = make_archive(tmp_path, n_per_batch=6, n_test=6)
    monkeypatch.setenv(DL.URL_ENV, f"{base}/cifar-10-python.tar.gz")
    monkeypatch.setenv(DL.MD5_ENV, md5)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    argv = ["--recipe", "cpu-quick", "--data-dir", str(tmp_path / "data"), "--subset", "25,5",
            "--model", "tiny", "--batch", "8", "--steps", "1", "--eval-every", "0",
            "--no-final-eval", "--no-progress", "--randaugment", "0", "--cpu-devices", "8"]
    for run in range(2):
        assert cli.main_guard(lambda: train_shardmap.main(argv)) == 0
        out = capsys.readouterr().out
        assert ("downloading" in out) == (run == 0)
        assert "train 25, val 0, test 5" in out and "step 1 done" in out
    assert requests == ["/cifar-10-python.tar.gz"]


def test_download_from_local_file_url(tmp_path):
    archive, md5, _ = make_archive(tmp_path, n_per_batch=2, n_test=3)
    splits = D.load_cifar10(tmp_path / "data", url=archive.as_uri(), md5=md5, log=lambda s: None)
    assert {k: len(v) for k, v in splits.items()} == {"train": 9, "val": 1, "test": 3}
