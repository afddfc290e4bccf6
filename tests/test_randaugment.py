"""Tests for vit_pure/data/randaugment.py: every op's contract and behaviour, RandAugment's
per-example randomness (split-independent, shard_map-ready), mixup, CutMix and mix_batch.

Images use odd, distinct heights and widths so that a swapped axis fails.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from vit_pure import PRESETS, LossScale, Policy, step
from vit_pure.data import augment as aug
from vit_pure.data import randaugment as ra
from vit_pure.run import cli

H, W = 9, 11
NO_MAGNITUDE_OPS = (ra.identity, ra.auto_contrast, ra.equalize, ra.invert)
MAGNITUDE_OPS = tuple(op for op in ra.ALL_OPS if op not in NO_MAGNITUDE_OPS)
UNSIGNED_OPS = tuple(op for op in ra.ALL_OPS if op not in ra.SIGNED_OPS)


def op_id(op):
    return op.__name__


def random_image(seed=0, shape=(H, W, 3)):
    """Uniform pixels, plus an exact 0 and an exact 1."""
    x = np.random.default_rng(seed).uniform(size=shape).astype(np.float32)
    x[0, 0, 0], x[0, 1, 1] = 0.0, 1.0
    return x


def ramp_image(h=H, w=W):
    """Linear in row and column (bilinear sampling reproduces it exactly)."""
    r, c, ch = np.meshgrid(np.arange(h), np.arange(w), np.arange(3), indexing="ij")
    return (0.2 + 0.03 * r + 0.02 * c + 0.05 * ch).astype(np.float32)


def ramp_value(r, c):
    return 0.2 + 0.03 * r + 0.02 * c + 0.05 * np.arange(3)


def check_warp_of_ramp(out, source_of):
    """out[r, c] == ramp(source_of(r, c)) wherever the source lies inside the image."""
    checked = 0
    for r in range(H):
        for c in range(W):
            rs, cs = source_of(r, c)
            if 0 <= rs <= H - 1 and 0 <= cs <= W - 1:
                np.testing.assert_allclose(out[r, c], ramp_value(rs, cs), atol=1e-5)
                checked += 1
    assert checked >= H * W // 3
    return checked


# --------------------------------------------------------------------------- op contract


@pytest.mark.parametrize("op", ra.ALL_OPS, ids=op_id)
def test_op_shape_dtype_range(op):
    x = random_image(shape=(24, 26, 3))  # >= 512 pixels so that equalize acts
    for magnitude in (0.3, 1.0):
        for key in (jax.random.key(0), jax.random.key(1), None):
            out = op(x, magnitude, key)
            assert out.shape == x.shape
            assert out.dtype == jnp.float32
            assert float(jnp.min(out)) >= 0.0 and float(jnp.max(out)) <= 1.0


@pytest.mark.parametrize("op", MAGNITUDE_OPS + (ra.identity,), ids=op_id)
def test_op_is_exact_identity_at_magnitude_zero(op):
    x = random_image()
    for key in (None, jax.random.key(0), jax.random.key(1), jax.random.key(2)):
        np.testing.assert_array_equal(np.asarray(op(x, 0.0, key)), x)


@pytest.mark.parametrize("op", MAGNITUDE_OPS, ids=op_id)
def test_op_changes_image_at_full_magnitude(op):
    x = random_image()
    assert np.abs(np.asarray(op(x, 1.0)) - x).max() > 1e-3


@pytest.mark.parametrize("op", (ra.auto_contrast, ra.equalize, ra.invert), ids=op_id)
def test_ops_without_magnitude_ignore_it(op):
    x = random_image(shape=(24, 26, 3))
    x = 0.2 + 0.5 * x  # low contrast, so auto_contrast and equalize have work to do
    full = np.asarray(op(x, 1.0))
    np.testing.assert_array_equal(np.asarray(op(x, 0.0)), full)
    assert np.abs(full - x).max() > 0.1


@pytest.mark.parametrize("op", ra.ALL_OPS, ids=op_id)
def test_op_is_deterministic_in_key(op):
    x = random_image(shape=(24, 26, 3))
    a = op(x, 0.7, jax.random.key(5))
    b = op(x, 0.7, jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("op", ra.SIGNED_OPS, ids=op_id)
def test_signed_op_takes_a_random_sign_from_the_key(op):
    x = random_image()
    plus, minus = np.asarray(op(x, 0.6)), np.asarray(op(x, -0.6))
    assert np.abs(plus - minus).max() > 1e-3
    signs = []
    for seed in range(16):
        out = np.asarray(op(x, 0.6, jax.random.key(seed)))
        is_plus, is_minus = np.array_equal(out, plus), np.array_equal(out, minus)
        assert is_plus != is_minus  # exactly one of the two directions
        signs.append(is_plus)
    assert any(signs) and not all(signs)  # both directions occur


@pytest.mark.parametrize("op", UNSIGNED_OPS, ids=op_id)
def test_unsigned_op_ignores_the_key(op):
    x = random_image(shape=(24, 26, 3))
    a = op(x, 0.7, jax.random.key(0))
    b = op(x, 0.7, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ops_are_jit_and_vmap_friendly():
    xs = np.stack([random_image(seed) for seed in range(3)])
    keys = jax.random.split(jax.random.key(0), 3)

    @jax.jit
    def all_ops_batched(xs, keys):  # one compilation for all ops
        return [jax.vmap(lambda x, k, op=op: op(x, 0.8, k))(xs, keys) for op in ra.ALL_OPS]

    for op, batched in zip(ra.ALL_OPS, all_ops_batched(xs, keys)):
        for i in range(3):
            np.testing.assert_allclose(batched[i], op(xs[i], 0.8, keys[i]), atol=1e-5)


# --------------------------------------------------------------------------- op behaviour


def test_invert_twice_is_identity():
    x = random_image()
    np.testing.assert_allclose(ra.invert(ra.invert(x)), x, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(ra.invert(x))[0, 0, 0], 1.0)


def test_auto_contrast_stretches_each_channel_to_full_range():
    x = random_image()
    x = 0.3 + 0.2 * x
    x[..., 2] = 0.4  # a constant channel stays as it is
    out = np.asarray(ra.auto_contrast(x))
    for ch in (0, 1):
        assert out[..., ch].min() == 0.0 and out[..., ch].max() == pytest.approx(1.0)
        expected = (x[..., ch] - x[..., ch].min()) / (x[..., ch].max() - x[..., ch].min())
        np.testing.assert_allclose(out[..., ch], expected, atol=1e-6)
    np.testing.assert_array_equal(out[..., 2], x[..., 2])


def equalize_reference(levels):
    """PIL's ImageOps.equalize for one uint8 channel, written with Python loops."""
    hist = np.bincount(levels.ravel(), minlength=256)
    nonzero = [h for h in hist if h]
    if len(nonzero) <= 1:
        return levels
    step = (sum(nonzero) - nonzero[-1]) // 255
    if not step:
        return levels
    lut, n = [], step // 2
    for i in range(256):
        lut.append(min(n // step, 255))
        n += hist[i]
    return np.array(lut)[levels]


def test_equalize_matches_pil_algorithm():
    rng = np.random.default_rng(3)
    # A skewed histogram (squared uniform), so equalisation moves most pixels. 32 x 40 pixels:
    # PIL's integer step (pixels // 255) is then close to pixels / 255, so the result is flat.
    levels = (255 * rng.uniform(size=(32, 40, 3)) ** 2).round().astype(np.int64)
    levels[..., 2] = 77  # constant channel: unchanged
    x = (levels / 255.0).astype(np.float32)
    out = np.asarray(ra.equalize(x))
    for ch in range(3):
        expected = equalize_reference(levels[..., ch]) / 255.0
        np.testing.assert_allclose(out[..., ch], expected, atol=1e-6)
    assert np.abs(out[..., :2] - x[..., :2]).max() > 0.1
    np.testing.assert_array_equal(out[..., 2], x[..., 2])
    # Equalised histogram: each quarter of the levels holds roughly a quarter of the pixels.
    quarters = np.histogram(out[..., 0], bins=4, range=(0, 1))[0] / out[..., 0].size
    np.testing.assert_allclose(quarters, 0.25, atol=0.06)


def test_equalize_leaves_images_with_under_256_pixels_unchanged():
    # PIL: step = (pixels - count of the top level) // 255 == 0 -> identity.
    x = random_image()  # 99 pixels
    np.testing.assert_array_equal(np.asarray(ra.equalize(x)), x)


def test_affine_warp_by_90_degrees_is_rot90():
    x = random_image(shape=(9, 9, 3))
    out = ra.affine_warp(x, ra.rotation_matrix(90.0))
    np.testing.assert_allclose(out, np.rot90(x, k=1, axes=(0, 1)), atol=1e-5)  # ccw
    out = ra.affine_warp(x, ra.rotation_matrix(-90.0))
    np.testing.assert_allclose(out, np.rot90(x, k=-1, axes=(0, 1)), atol=1e-5)


def test_rotate_samples_the_rotated_position():
    x = ramp_image()
    out = np.asarray(ra.rotate(x, 0.5))  # +15 degrees
    cos, sin = np.cos(np.deg2rad(15.0)), np.sin(np.deg2rad(15.0))
    r0, c0 = (H - 1) / 2, (W - 1) / 2

    def source(r, c):
        return r0 + cos * (r - r0) + sin * (c - c0), c0 - sin * (r - r0) + cos * (c - c0)

    check_warp_of_ramp(out, source)
    assert np.all(out[0, 0] == ra.FILL_VALUE)  # a corner maps from outside


def test_rotate_turns_a_blob_counter_clockwise_by_30_degrees():
    size, radius = 17, 5.0
    centre = (size - 1) / 2
    r, c = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    blob = np.exp(-((r - centre) ** 2 + (c - centre - radius) ** 2) / 2.0)  # right of centre
    x = np.repeat(blob[..., None], 3, axis=-1).astype(np.float32)
    moved = np.asarray(ra.rotate(x, 1.0)) - np.asarray(ra.rotate(np.zeros_like(x), 1.0))
    weights = moved[..., 0]
    centroid = (np.sum(weights * r) / weights.sum(), np.sum(weights * c) / weights.sum())
    angle = np.deg2rad(30.0)
    expected = (centre - radius * np.sin(angle), centre + radius * np.cos(angle))  # up, right
    np.testing.assert_allclose(centroid, expected, atol=0.1)


def test_solarize_inverts_at_and_above_the_threshold():
    levels = np.arange(256).reshape(16, 16, 1).repeat(3, axis=-1)
    x = (levels / 255.0).astype(np.float32)
    out = np.asarray(ra.solarize(x, 0.5))  # threshold 128 of 255
    np.testing.assert_allclose(out, np.where(levels >= 128, 1.0 - x, x), atol=1e-7)
    np.testing.assert_allclose(ra.solarize(x, 1.0), 1.0 - x, atol=1e-7)  # threshold 0


def test_posterize_puts_values_on_the_coarser_grid():
    x = random_image(shape=(24, 26, 3))
    levels = np.round(x * 255)
    for magnitude, bits in ((1.0, 4), (0.9, 4), (0.5, 6)):
        out_levels = np.asarray(ra.posterize(x, magnitude)) * 255
        np.testing.assert_allclose(out_levels, np.round(out_levels), atol=1e-3)
        out_levels = np.round(out_levels)
        step = 2 ** (8 - bits)
        assert np.all(out_levels % step == 0)
        assert np.all((out_levels <= levels) & (out_levels > levels - step))  # drops low bits
    assert len(np.unique(np.round(np.asarray(ra.posterize(x, 1.0)) * 255))) == 16


def luma(x):
    return np.sum(x * np.array(ra.LUMA_WEIGHTS, np.float32), axis=-1, keepdims=True)


def test_color_scales_the_distance_from_grey():
    x = 0.3 + 0.4 * random_image()  # no clipping for factors 0.1 and 1.45
    grey = luma(x)
    for magnitude, factor in ((-1.0, 0.1), (0.5, 1.45)):
        out = np.asarray(ra.color(x, magnitude))
        np.testing.assert_allclose(out - grey, factor * (x - grey), atol=1e-6)
    grey_image = np.repeat(grey, 3, axis=-1)
    np.testing.assert_allclose(ra.color(grey_image, 1.0), grey_image, atol=1e-6)


def test_contrast_scales_the_distance_from_the_mean_grey():
    x = 0.3 + 0.4 * random_image()
    mean = luma(x).mean()
    for magnitude, factor in ((-1.0, 0.1), (0.5, 1.45)):
        out = np.asarray(ra.contrast(x, magnitude))
        np.testing.assert_allclose(out - mean, factor * (x - mean), atol=1e-6)


def test_brightness_scales_and_clips():
    x = random_image()
    np.testing.assert_allclose(ra.brightness(x, -1.0), 0.1 * x, atol=1e-6)
    np.testing.assert_allclose(ra.brightness(x, 0.5), np.minimum(1.45 * x, 1.0), atol=1e-6)


def test_sharpness_blends_with_pil_smoothing():
    x = 0.3 + 0.4 * random_image()
    smooth = x.copy()
    kernel = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13
    for r in range(1, H - 1):
        for c in range(1, W - 1):
            smooth[r, c] = np.einsum("ij,ijk->k", kernel, x[r - 1 : r + 2, c - 1 : c + 2])
    for magnitude, factor in ((1.0, 1.9), (-1.0, 0.1)):
        out = np.asarray(ra.sharpness(x, magnitude))
        np.testing.assert_allclose(out, np.clip(smooth + factor * (x - smooth), 0, 1),
                                   atol=1e-6)
        np.testing.assert_array_equal(out[0], x[0])  # border kept, as in PIL
        np.testing.assert_array_equal(out[:, -1], x[:, -1])
    flat = np.full((H, W, 3), 0.6, np.float32)
    np.testing.assert_allclose(ra.sharpness(flat, 1.0), flat, atol=1e-6)


def test_shear_x_shifts_rows_in_proportion_to_their_offset():
    x = ramp_image()
    out = np.asarray(ra.shear_x(x, 1.0))  # s = 0.3
    r0 = (H - 1) // 2
    check_warp_of_ramp(out, lambda r, c: (r, c + 0.3 * (r - r0)))
    np.testing.assert_array_equal(out[r0], x[r0])  # the centre row does not move


def test_shear_y_shifts_columns_in_proportion_to_their_offset():
    x = ramp_image()
    out = np.asarray(ra.shear_y(x, -1.0))  # s = -0.3
    c0 = (W - 1) // 2
    check_warp_of_ramp(out, lambda r, c: (r - 0.3 * (c - c0), c))
    np.testing.assert_array_equal(out[:, c0], x[:, c0])


def test_translate_x_moves_a_pixel_right_and_fills_grey():
    x = np.zeros((H, W, 3), np.float32)
    x[4, 2] = 1.0
    out = np.asarray(ra.translate_x(x, 9.0 / W))  # 9/W * W/3 = 3 pixels right
    expected = np.zeros_like(x)
    expected[4, 5] = 1.0
    expected[:, :3] = ra.FILL_VALUE
    np.testing.assert_allclose(out, expected, atol=1e-5)
    back = np.asarray(ra.translate_x(x, -6.0 / W))  # 2 pixels left
    assert back[4, 0].min() > 1 - 1e-5 and np.all(back[:, -2:] == ra.FILL_VALUE)


def test_translate_y_moves_a_pixel_down_and_fills_grey():
    x = np.zeros((H, W, 3), np.float32)
    x[2, 4] = 1.0
    out = np.asarray(ra.translate_y(x, 1.0))  # H/3 = 3 pixels down
    expected = np.zeros_like(x)
    expected[5, 4] = 1.0
    expected[:3] = ra.FILL_VALUE
    np.testing.assert_allclose(out, expected, atol=1e-5)
    check_warp_of_ramp(np.asarray(ra.translate_y(ramp_image(), 0.5)),
                       lambda r, c: (r - 0.5 * H / 3, c))


# --------------------------------------------------------------------------- RandAugment

BATCH = np.stack([random_image(seed, shape=(10, 12, 3)) for seed in range(8)])
IDS = np.arange(8, dtype=np.int32)
rand_augment = jax.jit(ra.rand_augment,
                       static_argnames=("num_ops", "magnitude", "ops", "one_warp"))


@pytest.fixture(scope="module")
def augmented_batch():
    """rand_augment of BATCH with key 42 and default settings, computed once."""
    return np.asarray(rand_augment(jax.random.key(42), BATCH, IDS))


def test_rand_augment_does_not_depend_on_how_the_batch_is_split(augmented_batch):
    key = jax.random.key(42)
    whole = augmented_batch
    halves = np.concatenate([np.asarray(rand_augment(key, BATCH[:4], IDS[:4])),
                             np.asarray(rand_augment(key, BATCH[4:], IDS[4:]))])
    np.testing.assert_allclose(halves, whole, atol=1e-6)
    order = np.array([5, 2, 7, 0, 1, 6, 3, 4])  # same ids in another order
    shuffled = np.asarray(rand_augment(key, BATCH[order], IDS[order]))
    np.testing.assert_allclose(shuffled, whole[order], atol=1e-6)
    assert np.abs(whole - BATCH).max() > 0.1  # it did augment


def test_rand_augment_under_shard_map_matches_one_device(augmented_batch):
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    key = jax.random.key(42)

    @jax.jit
    def sharded(key, images, ids):
        return jax.shard_map(
            lambda k, x, i: ra.rand_augment(k, x, i), mesh=mesh,
            in_specs=(P(), P("data"), P("data")), out_specs=P("data"))(key, images, ids)

    np.testing.assert_allclose(np.asarray(sharded(key, BATCH, IDS)), augmented_batch, atol=1e-6)


def test_one_warp_per_slot_gives_the_plain_switchs_images():
    """rand_augment's default (the drawn op's affine selected, one warp per op slot) gives
    the images of the plain switch over all ops (a warp per geometric op), image by image:
    64 examples x 2 slots draw every op several times. Up to float32 rounding (measured:
    21 of 23,040 values differ, by <= 1.6e-6): XLA evaluates the rotation's sine and
    cosine in another fusion; a different op drawn anywhere would differ by > 0.01."""
    images = np.concatenate([BATCH] * 8)
    ids = np.arange(64, dtype=np.int32)
    key = jax.random.key(5)
    fused = np.asarray(rand_augment(key, images, ids))
    plain = np.asarray(rand_augment(key, images, ids, one_warp=False))
    np.testing.assert_allclose(fused, plain, rtol=0, atol=1e-5)
    assert np.abs(fused - images).max() > 0.1


def test_rand_augment_is_deterministic_in_the_key(augmented_batch):
    a = np.asarray(rand_augment(jax.random.key(42), BATCH, IDS))
    b = augmented_batch
    c = np.asarray(rand_augment(jax.random.key(2), BATCH, IDS))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 0.1
    assert np.all((a >= 0) & (a <= 1)) and a.shape == BATCH.shape and a.dtype == np.float32


def test_rand_augment_jit_matches_eager():
    ops = (ra.invert, ra.solarize, ra.contrast)
    key = jax.random.key(7)
    eager = ra.rand_augment(key, BATCH[:3], IDS[:3], ops=ops)
    np.testing.assert_allclose(rand_augment(key, BATCH[:3], IDS[:3], ops=ops), eager,
                               atol=1e-5)
    assert np.abs(eager - BATCH[:3]).max() > 0.1


def test_rand_augment_picks_ops_per_example_uniformly():
    images = np.repeat(BATCH[:1], 200, axis=0)
    ids = np.arange(200, dtype=np.int32)
    out = np.asarray(rand_augment(jax.random.key(0), images, ids, num_ops=1,
                                  ops=(ra.identity, ra.invert)))
    kept = np.all(out == images, axis=(1, 2, 3))
    inverted = np.all(np.abs(out - (1 - images)) < 1e-6, axis=(1, 2, 3))
    assert np.all(kept ^ inverted)
    assert 0.35 < kept.mean() < 0.65


def test_rand_augment_applies_num_ops_in_sequence_at_the_given_magnitude():
    out = rand_augment(jax.random.key(0), BATCH, IDS, num_ops=3, ops=(ra.invert,))
    np.testing.assert_allclose(out, 1 - BATCH, atol=1e-6)  # inverted three times
    out = rand_augment(jax.random.key(0), BATCH, IDS, num_ops=1, magnitude=5,
                       ops=(ra.solarize,))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ra.solarize(BATCH, 0.5)))
    out = rand_augment(jax.random.key(0), BATCH, IDS, ops=(ra.identity,))
    np.testing.assert_array_equal(np.asarray(out), BATCH)


# --------------------------------------------------------------------------- mixup, CutMix

MIX_IMAGES = np.stack([random_image(seed) for seed in range(6)])
CLASSES = np.array([3, 0, 7, 1, 9, 4])
MIX_LABELS = np.eye(10, dtype=np.float32)[CLASSES]
PAIRS = np.array([1, 0, 3, 2, 5, 4])  # each row's partner: global examples 2k <-> 2k+1
mixup = jax.jit(aug.mixup, static_argnames="alpha")
cutmix = jax.jit(aug.cutmix, static_argnames="alpha")
mix_batch = jax.jit(aug.mix_batch, static_argnames=("mixup_alpha", "cutmix_alpha", "switch_prob"))


def own_weight(labels):
    """Each row's weight on its own class (partners always have another class here)."""
    return np.asarray(labels)[np.arange(len(CLASSES)), CLASSES]


def test_mixup_is_a_convex_combination_with_the_neighbouring_partner():
    lams = []
    for seed in range(8):
        images, labels = mixup(jax.random.key(seed), MIX_IMAGES, MIX_LABELS, alpha=1.0)
        np.testing.assert_allclose(np.sum(labels, axis=1), 1.0, atol=1e-6)
        lam = own_weight(labels)
        np.testing.assert_allclose(lam, lam[0], atol=1e-6)  # one lambda per batch
        assert 0.0 <= lam[0] <= 1.0
        np.testing.assert_allclose(
            labels, lam[0] * MIX_LABELS + (1 - lam[0]) * MIX_LABELS[PAIRS], atol=1e-6)
        np.testing.assert_allclose(
            images, lam[0] * MIX_IMAGES + (1 - lam[0]) * MIX_IMAGES[PAIRS], atol=1e-6)
        lams.append(lam[0])
    assert np.std(lams) > 0.05  # lambda is drawn from the key


def box_mask(images):
    """Pixels taken from the partner; asserts each pixel is exactly own or partner's."""
    images = np.asarray(images)
    own = np.all(images == MIX_IMAGES, axis=-1)
    partner = np.all(images == MIX_IMAGES[PAIRS], axis=-1)
    assert np.all(own | partner)
    return partner


def test_cutmix_pastes_one_box_and_mixes_labels_by_its_area():
    areas = []
    for seed in range(8):
        images, labels = cutmix(jax.random.key(seed), MIX_IMAGES, MIX_LABELS, alpha=1.0)
        np.testing.assert_allclose(np.sum(labels, axis=1), 1.0, atol=1e-6)
        mask = box_mask(images)
        assert np.all(mask == mask[0])  # the same box in every image
        rows, cols = np.nonzero(mask[0])
        if rows.size:  # a filled rectangle
            assert rows.size == (np.ptp(rows) + 1) * (np.ptp(cols) + 1)
        area = mask[0].mean()
        np.testing.assert_allclose(own_weight(labels), 1 - area, atol=1e-6)
        areas.append(area)
    assert np.std(areas) > 0.02 and max(areas) > 0


def test_cutmix_box_is_sized_from_lambda_and_clipped():
    height, width = 33, 41  # lam 0.75: side ratio sqrt(0.25), a 16 x 20 box before clipping
    box = jax.jit(jax.vmap(aug.cutmix_box, in_axes=(0, None, None, None)), static_argnums=(1, 2))
    rows0, rows1, cols0, cols1 = map(np.asarray, box(
        jax.random.split(jax.random.key(0), 64), height, width, 0.75))
    assert np.all((0 <= rows0) & (rows0 < rows1) & (rows1 <= height))
    assert np.all((0 <= cols0) & (cols0 < cols1) & (cols1 <= width))
    for start, stop, size, side in ((rows0, rows1, height, 16), (cols0, cols1, width, 20)):
        full = stop - start == side
        assert np.all(full | (start == 0) | (stop == size))  # shorter only where clipped
        assert np.all(stop - start <= side)
        assert full.any() and not full.all()


def test_partners_are_neighbours_and_an_odd_batch_is_refused():
    np.testing.assert_array_equal(np.asarray(aug.partners(jnp.arange(6))), PAIRS)
    for fn in (mixup, cutmix):
        with pytest.raises(ValueError, match="per-device batch 5 must be even"):
            fn(jax.random.key(0), MIX_IMAGES[:5], MIX_LABELS[:5], alpha=1.0)


@pytest.mark.parametrize("fn", [aug.mixup, aug.cutmix], ids=op_id)
def test_alpha_zero_is_identity(fn):
    images, labels = fn(jax.random.key(0), MIX_IMAGES, MIX_LABELS, alpha=0.0)
    np.testing.assert_array_equal(np.asarray(images), MIX_IMAGES)
    np.testing.assert_array_equal(np.asarray(labels), MIX_LABELS)


def test_mix_batch_chooses_between_mixup_and_cutmix():
    kinds = set()
    for seed in range(10):
        images, labels = mix_batch(jax.random.key(seed), MIX_IMAGES, MIX_LABELS,
                                   mixup_alpha=1.0, cutmix_alpha=1.0)
        np.testing.assert_allclose(np.sum(labels, axis=1), 1.0, atol=1e-6)
        images = np.asarray(images)
        is_cut = np.all((images == MIX_IMAGES) | (images == MIX_IMAGES[PAIRS]))
        if not is_cut:
            lam = own_weight(labels)[0]
            np.testing.assert_allclose(images, lam * MIX_IMAGES + (1 - lam) * MIX_IMAGES[PAIRS],
                                       atol=1e-6)
        kinds.add(is_cut)
    assert kinds == {True, False}
    key = jax.random.key(3)
    for kwargs, fn in (({"mixup_alpha": 1.0, "cutmix_alpha": 0.0}, mixup),
                       ({"mixup_alpha": 0.0, "cutmix_alpha": 1.0}, cutmix)):
        got = aug.mix_batch(key, MIX_IMAGES, MIX_LABELS, **kwargs)  # eager
        want = fn(key, MIX_IMAGES, MIX_LABELS, alpha=1.0)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-6)
    images, labels = aug.mix_batch(key, MIX_IMAGES, MIX_LABELS, mixup_alpha=0.0, cutmix_alpha=0.0)
    np.testing.assert_array_equal(np.asarray(images), MIX_IMAGES)
    np.testing.assert_array_equal(np.asarray(labels), MIX_LABELS)


# ----------------------------------------------------- mixing under data parallelism
# One training step with mixup / CutMix on, as train_shardmap runs it over 'data' (params
# marked varying, the local gradient, one explicit pmean), on 1 and 8 fake devices (8: two
# examples a device, the one pair each device mixes).
MIX_CFG = PRESETS["tiny"].replace(name="mix-test", depth=2, dropout=0.0, drop_path=0.0)
MIX_BATCH = 16


def mix_test_batch():
    """(uint8 images, labels, global example ids, step key) of the test step."""
    rng = np.random.default_rng(0)
    return (rng.integers(0, 256, (MIX_BATCH, 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, (MIX_BATCH,), dtype=np.int32),
            np.arange(MIX_BATCH, dtype=np.int32), step.step_key(0, 0, 0))


def data_parallel_grads(sc, params, devices: int):
    """(grads, loss) of one step on a 'data' mesh of `devices` devices, on the host."""
    images, labels, ids, key = mix_test_batch()
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))

    def per_device(p, images, labels, ids, key):
        p = lax.pcast(p, "data", to="varying")  # the gradient pitfall: see train_shardmap.py
        grads, metrics = step.local_grads(sc, p, LossScale.create(dynamic=False), images,
                                          labels, ids, key)
        return lax.pmean((grads, metrics["loss"]), "data")

    f = jax.jit(jax.shard_map(per_device, mesh=mesh,
                              in_specs=(P(), P("data"), P("data"), P("data"), P()),
                              out_specs=P()))
    return jax.device_get(f(params, images, labels, ids, key))


@pytest.mark.parametrize("alphas", [{"mixup_alpha": 0.8}, {"cutmix_alpha": 1.0}],
                         ids=["mixup", "cutmix"])
def test_mixing_gives_the_same_step_on_1_and_8_devices(alphas):
    sc = step.StepConfig(MIX_CFG, Policy(), **alphas)
    params = step.init_params(jax.random.key(0), MIX_CFG)
    (ref_grads, ref_loss), *others = [data_parallel_grads(sc, params, d) for d in (1, 8)]
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    for grads, loss in others:
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * scale)
    # ... and this step did mix: most targets are two classes (lambda or box not 0 / 1).
    images, labels, ids, key = mix_test_batch()
    prepare = jax.jit(step.prepare_batch, static_argnums=0)
    targets = np.asarray(prepare(sc, images, labels, ids, key)[1])
    assert np.sum(targets.max(axis=1) < 0.99) >= MIX_BATCH // 2


def test_mixing_refuses_an_odd_per_device_batch():
    """Pairs are (2k, 2k+1): a device holding 3 examples could not pair its last one."""
    sc = step.StepConfig(MIX_CFG, Policy(), mixup_alpha=0.8)
    images = np.zeros((3, 32, 32, 3), np.uint8)
    labels, ids = np.zeros(3, np.int32), np.arange(3, dtype=np.int32)
    with pytest.raises(cli.UsageError, match="per-device batch 3 .* even"):
        jax.eval_shape(lambda p: step.local_grads(
            sc, p, LossScale.create(dynamic=False), images, labels, ids, step.step_key(0, 0, 0)),
            step.init_params(jax.random.key(0), MIX_CFG))
