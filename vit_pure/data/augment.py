"""On-device augmentation of a training batch, in pure jax.numpy (inside jit / shard_map):
random horizontal flip + random resized crop, and mixup / CutMix (`mix_batch`).
RandAugment's ops are vit_pure/data/randaugment.py; `step.prepare_images` runs them in
order (flip + crop, then RandAugment, then mixup / CutMix on the one-hot targets too).

Per-example randomness comes from ``fold_in(key, example_id)`` with the example's *global*
position in the batch, so a batch gives the same augmented images however it is split
across devices or processes; mixup's pairs never cross a device (`mix_batch`).

Sources: mixup, H. Zhang, M. Cisse, Y. N. Dauphin, D. Lopez-Paz, arXiv:1710.09412 (2017).
CutMix, S. Yun, D. Han, S. J. Oh, S. Chun, J. Choe, Y. Yoo, arXiv:1905.04899 (2019).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# ------------------------------------------------------------------- flip + resized crop
# Random resized crop ranges (fractions of the image area; width/height ratio).
CROP_SCALE = (0.9, 1.0)
CROP_RATIO = (0.9, 1.1)
# Evaluation's corner crops (--eval-corners): each a fraction of the image's area.
CORNER_CROP_AREA = 0.9
_AUGMENT_TAG = 0x61756700  # 'aug\0': keeps augmentation keys apart from others drawn from seed


def augment_key(seed: int, epoch: int, step: int) -> jax.Array:
    """The augmentation key of one training step: key(seed) -> tag -> epoch -> step."""
    key = jax.random.fold_in(jax.random.key(seed), _AUGMENT_TAG)
    return jax.random.fold_in(jax.random.fold_in(key, epoch), step)


def crop_params(key: jax.Array, height: int, width: int):
    """One example's (top, left, crop_h, crop_w, flip) from its key.

    Area fraction ~ U(CROP_SCALE); log aspect ratio (w/h) ~ U(log CROP_RATIO); the
    crop is clipped to the image and placed uniformly (sub-pixel) inside it.
    """
    u = jax.random.uniform(key, (5,), jnp.float32)
    scale = CROP_SCALE[0] + (CROP_SCALE[1] - CROP_SCALE[0]) * u[0]
    log_lo, log_hi = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
    ratio = jnp.exp(log_lo + (log_hi - log_lo) * u[1])
    crop_w = jnp.minimum(width * jnp.sqrt(scale * ratio), width)
    crop_h = jnp.minimum(height * jnp.sqrt(scale / ratio), height)
    top = (height - crop_h) * u[2]
    left = (width - crop_w) * u[3]
    flip = u[4] < 0.5
    return top, left, crop_h, crop_w, flip


def _sample_points(start, length, n: int):
    """Bilinear sampling of [start, start+length) at n output pixels (one axis).

    Output pixel o samples the input at its centre, start + (o + 0.5) * length/n,
    in pixel-centre coordinates (-0.5), between input pixels i0 and i1 = i0 + 1
    with weight frac on i1; neighbours outside the image are clamped.
    """
    o = jnp.arange(n, dtype=jnp.float32)
    c = jnp.clip(start + (o + 0.5) * (length / n) - 0.5, 0.0, n - 1.0)
    i0 = jnp.floor(c)
    frac = c - i0
    i0 = i0.astype(jnp.int32)
    return i0, jnp.minimum(i0 + 1, n - 1), frac


def crop_flip_resize(image: jax.Array, top, left, crop_h, crop_w, flip) -> jax.Array:
    """One HWC image: crop the box, resize it bilinearly back to HxW, maybe mirror it.

    Separable: blend two gathered rows per output row, then two gathered columns
    per output column. The mirror is the column sample points in reverse order.
    """
    h, w, _ = image.shape
    y0, y1, fy = _sample_points(top, crop_h, h)                 # (h_out,)
    x0, x1, fx = _sample_points(left, crop_w, w)                # (w_out,)
    x0, x1, fx = (jnp.where(flip, a[::-1], a) for a in (x0, x1, fx))
    x = image.astype(jnp.float32)
    rows = x[y0] + (x[y1] - x[y0]) * fy[:, None, None]          # (h_out, w_in, c)
    out = rows[:, x0] + (rows[:, x1] - rows[:, x0]) * fx[None, :, None]  # (h_out, w_out, c)
    return out.astype(image.dtype)


def augment(key: jax.Array, images: jax.Array, example_ids: jax.Array) -> jax.Array:
    """Random horizontal flip + random resized crop of a float NHWC batch.

    example_ids: (N,) int32, each example's position in the *global* batch; its
    key is fold_in(key, example_id), so results do not depend on how the global
    batch is split over devices or processes. Same shape and dtype out.
    """
    _, h, w, _ = images.shape
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, example_ids.astype(jnp.int32))

    def one(k, image):
        return crop_flip_resize(image, *crop_params(k, h, w))

    return jax.vmap(one)(keys, images)


def corner_crops(images: jax.Array, area: float = CORNER_CROP_AREA) -> list[jax.Array]:
    """The four corner crops of an NHWC batch, each `area` of the image, resized back.

    Test-time views (step.eval_sums, --eval-corners): with the whole image they are the
    ten-crop evaluation's five views, the whole image in place of the centre crop.
    """
    _, h, w, _ = images.shape
    crop_h, crop_w = h * math.sqrt(area), w * math.sqrt(area)
    corners = [(top, left) for top in (0.0, h - crop_h) for left in (0.0, w - crop_w)]
    return [jax.vmap(crop_flip_resize, in_axes=(0, None, None, None, None, None))(
        images, top, left, crop_h, crop_w, False) for top, left in corners]


# ------------------------------------------------------------------------ mixup, CutMix
def partners(x):
    """Each example's mixing partner: rows (0, 1, 2, 3, ...) -> (1, 0, 3, 2, ...).

    Row i holds global example g = start + i; with `start` even (true of every device's
    slice, see the module docstring) row i ^ 1 holds example g ^ 1. ValueError (one line)
    for an odd number of rows, which cannot be paired.
    """
    n = x.shape[0]
    if n % 2:
        raise ValueError(f"mixup / CutMix pair examples 2k and 2k+1 on one device: "
                         f"the per-device batch {n} must be even")
    return x.reshape(n // 2, 2, *x.shape[1:])[:, ::-1].reshape(x.shape)


def mixup_with_lambda(images, labels, lam):
    """x = lam * x + (1 - lam) * partners(x), and the same for the labels."""
    lam_x = jnp.asarray(lam, images.dtype)
    lam_y = jnp.asarray(lam, labels.dtype)
    return (lam_x * images + (1.0 - lam_x) * partners(images),
            lam_y * labels + (1.0 - lam_y) * partners(labels))


def cutmix_box(key, height, width, lam):
    """CutMix box (Yun et al. 2019): sides floor(H * sqrt(1 - lam)) and floor(W * sqrt(1 -
    lam)), centre uniform over the pixels, then clipped to the image. Returns int32 (row0,
    row1, col0, col1), half-open."""
    key_r, key_c = jax.random.split(key)
    cut = jnp.sqrt(1.0 - lam)
    box_h = jnp.floor(height * cut).astype(jnp.int32)
    box_w = jnp.floor(width * cut).astype(jnp.int32)
    centre_r = jax.random.randint(key_r, (), 0, height)
    centre_c = jax.random.randint(key_c, (), 0, width)
    row0 = centre_r - box_h // 2
    col0 = centre_c - box_w // 2
    return (jnp.clip(row0, 0, height), jnp.clip(row0 + box_h, 0, height),
            jnp.clip(col0, 0, width), jnp.clip(col0 + box_w, 0, width))


def cutmix_with_lambda(key, images, labels, lam):
    """Paste the box for `lam` (position from `key`) from each image's partner into it;
    mix the labels by the box's actual (clipped) area: lam' = 1 - area / (H * W)."""
    _, height, width, _ = images.shape
    row0, row1, col0, col1 = cutmix_box(key, height, width, lam)
    rows = jnp.arange(height)[:, None]
    cols = jnp.arange(width)[None, :]
    in_box = (rows >= row0) & (rows < row1) & (cols >= col0) & (cols < col1)  # (H, W)
    mixed = jnp.where(in_box[None, :, :, None], partners(images), images)
    lam_area = 1.0 - ((row1 - row0) * (col1 - col0)) / (height * width)
    lam_y = lam_area.astype(labels.dtype)
    return mixed, lam_y * labels + (1.0 - lam_y) * partners(labels)


def mixup(key, images, labels_onehot, *, alpha):
    """mixup (Zhang et al. 2017) with one lam ~ Beta(alpha, alpha) for the batch.

    Examples 2k and 2k+1 are partners (`partners`); pass the same key on every device.
    `alpha` is a Python float; alpha <= 0 returns the inputs unchanged. Returns (images,
    labels).
    """
    if alpha <= 0:
        return images, labels_onehot
    lam = jax.random.beta(key, alpha, alpha)
    return mixup_with_lambda(images, labels_onehot, lam)


def cutmix(key, images, labels_onehot, *, alpha):
    """CutMix (Yun et al. 2019): lam ~ Beta(alpha, alpha) sets one box for the batch, filled
    from each image's partner; labels are mixed by the box's actual area after clipping.

    Same batch-level caveats as `mixup`. alpha <= 0 returns the inputs unchanged.
    Returns (images, labels).
    """
    if alpha <= 0:
        return images, labels_onehot
    key_lam, key_box = jax.random.split(key)
    lam = jax.random.beta(key_lam, alpha, alpha)
    return cutmix_with_lambda(key_box, images, labels_onehot, lam)


def mix_batch(key, images, labels_onehot, *, mixup_alpha, cutmix_alpha, switch_prob=0.5):
    """mixup or CutMix for the whole batch (alphas and switch_prob are Python floats).

    With both alphas > 0, CutMix is chosen with probability `switch_prob` (one draw per batch,
    then lam ~ Beta of the chosen alpha); with one > 0, that one (same as calling `mixup` or
    `cutmix` with this key); with both 0, the inputs unchanged. Returns (images, labels).

    Pairing, and why it does not depend on the device count: `images` is one device's
    slice of the global batch (or the whole batch on one device), rows start .. start+n-1
    with `start` a multiple of n. The partner of global example g is g XOR 1, which for
    even n is always in the same slice, at row i XOR 1 (`partners`): no device needs
    another device's pixels, so no collective. The random draws (mixup or CutMix, lambda,
    the box) come from `key` alone, once per call: give every device the step's key and
    every device draws the same. So 1, 2 or 8 devices compute the same mixed batch, and
    the same step. An odd n (an odd per-device batch) is refused with a ValueError; the
    training step reports it as a usage error.
    """
    if mixup_alpha > 0 and cutmix_alpha > 0:
        key_choice, key_lam, key_box = jax.random.split(key, 3)
        use_cutmix = jax.random.bernoulli(key_choice, switch_prob)
        alpha = jnp.where(use_cutmix, cutmix_alpha, mixup_alpha)
        lam = jax.random.beta(key_lam, alpha, alpha)  # one Beta sampler for both branches
        return lax.cond(
            use_cutmix,
            lambda: cutmix_with_lambda(key_box, images, labels_onehot, lam),
            lambda: mixup_with_lambda(images, labels_onehot, lam),
        )
    if mixup_alpha > 0:
        return mixup(key, images, labels_onehot, alpha=mixup_alpha)
    if cutmix_alpha > 0:
        return cutmix(key, images, labels_onehot, alpha=cutmix_alpha)
    return images, labels_onehot
