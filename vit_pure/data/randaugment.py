"""On-device RandAugment, in pure jax.numpy (flip + crop and mixup / CutMix: data/augment.py).

Everything here runs inside jit / vmap / shard_map: no host callbacks, no Python loops over
images. Images are float32 HWC (one image) or NHWC (a batch) in [0, 1], not yet normalised.
Every single-image op is ``op(image, magnitude, key=None) -> image``, clipped to [0, 1];
``magnitude`` in [0, 1], 0 the identity for every op that has one. Signed ops take the sign
from ``key`` (a fair coin), or with ``key=None`` from ``magnitude`` itself, so
``rotate(img, -0.5)`` turns 15 degrees clockwise. identity, auto_contrast, equalize and
invert have no magnitude (as in the paper), so the last three act even at 0.

``rand_augment(key, images, example_ids, ...)`` draws per example from
``fold_in(key, example_id)`` with the examples' global batch positions, so any split of the
batch gives the same images; the op table, ranges, sources and cost are in its docstring.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FILL_VALUE = 0.5  # grey, for pixels that a geometric op maps from outside the image
MAX_LEVEL = 10  # RandAugment's magnitude scale: M in [0, MAX_LEVEL] maps to m = M / 10
MAX_ROTATE_DEGREES = 30.0
MAX_SHEAR = 0.3
MAX_TRANSLATE_FRACTION = 1.0 / 3.0
MAX_ENHANCE = 0.9  # blend factors 1 - 0.9 m .. 1 + 0.9 m
LUMA_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R 601-2, as PIL's convert("L")


# --------------------------------------------------------------------------- helpers


def _signed(magnitude, key):
    """magnitude with a random sign from key, or as given when key is None."""
    magnitude = jnp.asarray(magnitude, jnp.float32)
    if key is None:
        return magnitude
    return jnp.where(jax.random.bernoulli(key), magnitude, -magnitude)


def _clip(x):
    return jnp.clip(x, 0.0, 1.0)


def _blend(degenerate, image, factor):
    """PIL's ImageEnhance blend, written so that factor == 1 returns `image` exactly."""
    factor = jnp.asarray(factor, image.dtype)
    return _clip(image + (factor - 1.0) * (image - degenerate))


def _grey(image):
    """(H, W, 3) -> (H, W, 1) luma."""
    # Scalar weights, not a constant array: see the note in `rand_augment`.
    red, green, blue = LUMA_WEIGHTS
    return red * image[..., 0:1] + green * image[..., 1:2] + blue * image[..., 2:3]


def _to_uint8_levels(image):
    """[0, 1] floats -> int32 levels 0..255 (round to nearest)."""
    return jnp.clip(jnp.round(image * 255.0), 0, 255).astype(jnp.int32)


def bilinear_sample(image, rows, cols, fill=FILL_VALUE):
    """Sample image (H, W, C) at float pixel coordinates rows, cols (any equal shape S).

    Pixel (i, j) has its centre at coordinate (i, j). Corners outside the image read `fill`.
    At integer coordinates the result is the pixel itself, exactly. Returns S + (C,).
    """
    height, width, _ = image.shape
    r0 = jnp.floor(rows)
    c0 = jnp.floor(cols)
    fr = (rows - r0)[..., None]
    fc = (cols - c0)[..., None]
    r0 = r0.astype(jnp.int32)
    c0 = c0.astype(jnp.int32)

    def corner(r, c):
        inside = (r >= 0) & (r < height) & (c >= 0) & (c < width)
        value = image[jnp.clip(r, 0, height - 1), jnp.clip(c, 0, width - 1)]
        return jnp.where(inside[..., None], value, fill)

    top = corner(r0, c0) * (1.0 - fc) + corner(r0, c0 + 1) * fc
    bottom = corner(r0 + 1, c0) * (1.0 - fc) + corner(r0 + 1, c0 + 1) * fc
    return (top * (1.0 - fr) + bottom * fr).astype(image.dtype)


IDENTITY_MATRIX = ((1.0, 0.0), (0.0, 1.0))


def affine_warp(image, matrix=IDENTITY_MATRIX, offset=(0.0, 0.0), fill=FILL_VALUE):
    """Inverse-mapped affine warp about the image centre, bilinear, `fill` outside.

    Output pixel p = (row, col) takes the input at  matrix @ (p - centre) + centre + offset,
    with matrix ((a, b), (c, d)) and offset (dr, dc) in (row, col) order, given as nested
    pairs of scalars (or arrays of shape (2, 2) and (2,)). The identity matrix and a zero
    offset give the image back exactly.
    """
    height, width, _ = image.shape
    centre_r, centre_c = (height - 1) / 2.0, (width - 1) / 2.0
    rows, cols = jnp.meshgrid(
        jnp.arange(height, dtype=jnp.float32) - centre_r,
        jnp.arange(width, dtype=jnp.float32) - centre_c,
        indexing="ij",
    )
    src_r = matrix[0][0] * rows + matrix[0][1] * cols + centre_r + offset[0]
    src_c = matrix[1][0] * rows + matrix[1][1] * cols + centre_c + offset[1]
    return _clip(bilinear_sample(image, src_r, src_c, fill))


def rotation_matrix(degrees):
    """Inverse map (row, col) for a counter-clockwise (as displayed) turn by `degrees`."""
    theta = jnp.deg2rad(jnp.asarray(degrees, jnp.float32))
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    return ((cos, sin), (-sin, cos))


# --------------------------------------------------------------------------- ops


def identity(image, magnitude=0.0, key=None):
    del magnitude, key
    return image


def invert(image, magnitude=0.0, key=None):
    """1 - x. No magnitude."""
    del magnitude, key
    return _clip(1.0 - image)


def auto_contrast(image, magnitude=0.0, key=None):
    """Stretch each channel linearly so its min goes to 0 and max to 1. No magnitude.

    A constant channel is left as it is.
    """
    del magnitude, key
    lo = jnp.min(image, axis=(0, 1), keepdims=True)
    hi = jnp.max(image, axis=(0, 1), keepdims=True)
    has_range = hi > lo
    scale = 1.0 / jnp.where(has_range, hi - lo, 1.0)
    return jnp.where(has_range, _clip((image - lo) * scale), image)


def _equalize_channel(channel):
    """PIL ImageOps.equalize on one channel (H*W,) in [0, 1]."""
    levels = _to_uint8_levels(channel)
    hist = jnp.zeros(256, jnp.int32).at[levels].add(1)
    last_nonzero = jnp.max(jnp.where(hist > 0, jnp.arange(256), -1))
    step = (channel.size - hist[last_nonzero]) // 255
    safe_step = jnp.maximum(step, 1)
    below = jnp.cumsum(hist) - hist  # pixels strictly darker than each level
    lut = jnp.minimum((below + safe_step // 2) // safe_step, 255)
    equalized = lut[levels].astype(channel.dtype) / 255.0
    # step == 0: one level holds (almost) everything; PIL returns the image unchanged.
    return jnp.where(step > 0, equalized, channel)


def equalize(image, magnitude=0.0, key=None):
    """Per-channel histogram equalisation (256 bins, PIL's lookup table). No magnitude.

    Output is quantised to multiples of 1/255, except for channels left unchanged.
    """
    del magnitude, key
    height, width, channels = image.shape
    flat = image.reshape(height * width, channels)
    return jax.vmap(_equalize_channel, in_axes=1, out_axes=1)(flat).reshape(image.shape)


def rotate(image, magnitude, key=None):
    """Rotate about the centre by 30 * magnitude degrees (counter-clockwise for +)."""
    return affine_warp(image, *_rotate_affine(image.shape, magnitude, key))


def _rotate_affine(shape, magnitude, key):
    del shape
    return rotation_matrix(MAX_ROTATE_DEGREES * _signed(magnitude, key)), (0.0, 0.0)


def solarize(image, magnitude, key=None):
    """Invert pixels at or above 256 * (1 - magnitude) on the 0..255 scale (PIL semantics)."""
    del key
    threshold = (1.0 - magnitude) * (256.0 / 255.0)
    return jnp.where(image >= threshold, _clip(1.0 - image), image)


def posterize(image, magnitude, key=None):
    """Keep the top 8 - round(4 * magnitude) bits of each 8-bit level (8 bits = identity)."""
    del key
    dropped_bits = jnp.round(4.0 * jnp.asarray(magnitude, jnp.float32)).astype(jnp.int32)
    levels = _to_uint8_levels(image)
    kept = jnp.left_shift(jnp.right_shift(levels, dropped_bits), dropped_bits)
    return jnp.where(dropped_bits > 0, kept.astype(image.dtype) / 255.0, image)


def color(image, magnitude, key=None):
    """Saturation: blend with the grey image, factor 1 + 0.9 * signed magnitude."""
    factor = 1.0 + MAX_ENHANCE * _signed(magnitude, key)
    return _blend(_grey(image), image, factor)


def contrast(image, magnitude, key=None):
    """Blend with the image's mean grey level, factor 1 + 0.9 * signed magnitude."""
    factor = 1.0 + MAX_ENHANCE * _signed(magnitude, key)
    return _blend(jnp.mean(_grey(image)), image, factor)


def brightness(image, magnitude, key=None):
    """Blend with black (scale), factor 1 + 0.9 * signed magnitude."""
    factor = 1.0 + MAX_ENHANCE * _signed(magnitude, key)
    return _blend(jnp.zeros_like(image), image, factor)


def _smooth(image):
    """PIL's SMOOTH filter, kernel [[1,1,1],[1,5,1],[1,1,1]] / 13; border pixels unchanged."""
    image = jnp.asarray(image)
    height, width, _ = image.shape
    total = 4.0 * image[1:-1, 1:-1]  # centre weight 5 = 4 here + 1 in the 3x3 sum below
    for dr in range(3):
        for dc in range(3):
            total = total + image[dr : dr + height - 2, dc : dc + width - 2]
    return image.at[1:-1, 1:-1].set(total / 13.0)


def sharpness(image, magnitude, key=None):
    """Blend with the smoothed image, factor 1 + 0.9 * signed magnitude (> 1 sharpens)."""
    factor = 1.0 + MAX_ENHANCE * _signed(magnitude, key)
    return _blend(_smooth(image), image, factor)


def shear_x(image, magnitude, key=None):
    """Shear along x about the centre: output (r, c) reads input column c + s * (r - r0)."""
    return affine_warp(image, *_shear_x_affine(image.shape, magnitude, key))


def _shear_x_affine(shape, magnitude, key):
    del shape
    return ((1.0, 0.0), (MAX_SHEAR * _signed(magnitude, key), 1.0)), (0.0, 0.0)


def shear_y(image, magnitude, key=None):
    """Shear along y about the centre: output (r, c) reads input row r + s * (c - c0)."""
    return affine_warp(image, *_shear_y_affine(image.shape, magnitude, key))


def _shear_y_affine(shape, magnitude, key):
    del shape
    return ((1.0, MAX_SHEAR * _signed(magnitude, key)), (0.0, 1.0)), (0.0, 0.0)


def translate_x(image, magnitude, key=None):
    """Move the content right by magnitude * W / 3 pixels (left for negative)."""
    return affine_warp(image, *_translate_x_affine(image.shape, magnitude, key))


def _translate_x_affine(shape, magnitude, key):
    shift = MAX_TRANSLATE_FRACTION * shape[1] * _signed(magnitude, key)
    return IDENTITY_MATRIX, (0.0, -shift)


def translate_y(image, magnitude, key=None):
    """Move the content down by magnitude * H / 3 pixels (up for negative)."""
    return affine_warp(image, *_translate_y_affine(image.shape, magnitude, key))


def _translate_y_affine(shape, magnitude, key):
    shift = MAX_TRANSLATE_FRACTION * shape[0] * _signed(magnitude, key)
    return IDENTITY_MATRIX, (-shift, 0.0)


# The geometric ops as (matrix, offset) of their one `affine_warp`, for `rand_augment`.
_AFFINE = {rotate: _rotate_affine, shear_x: _shear_x_affine, shear_y: _shear_y_affine,
           translate_x: _translate_x_affine, translate_y: _translate_y_affine}


# The RandAugment paper's 14 ops, in its order.
DEFAULT_OPS = (
    identity,
    auto_contrast,
    equalize,
    rotate,
    solarize,
    color,
    posterize,
    contrast,
    brightness,
    sharpness,
    shear_x,
    shear_y,
    translate_x,
    translate_y,
)
ALL_OPS = DEFAULT_OPS + (invert,)
SIGNED_OPS = (rotate, color, contrast, brightness, sharpness, shear_x, shear_y,
              translate_x, translate_y)


# --------------------------------------------------------------------------- RandAugment


def rand_augment(key, images, example_ids, *, num_ops=2, magnitude=9, ops=DEFAULT_OPS,
                 one_warp=True):
    """RandAugment (Cubuk et al. 2019): per image, `num_ops` ops drawn uniformly (with
    replacement) from `ops`, applied in sequence, all at magnitude `magnitude` / 10.

    key: one PRNG key for the batch. images: (N, H, W, C) in [0, 1]. example_ids: (N,) int32
    global positions; example i uses fold_in(key, example_ids[i]), so splitting the batch
    does not change any image. `num_ops`, `magnitude` and `ops` are static.

    one_warp: under vmap a switch evaluates every op, and the five geometric ops are one
    bilinear warp each. With one_warp (the default) an op slot instead selects the drawn
    op's (matrix, offset) and warps once, and switches over the colour ops only: the same
    images (tests/test_randaugment.py checks it against one_warp=False, the plain switch
    over all ops), with one warp per slot instead of five.

    The ops, at m = magnitude / 10 (m in [0, 1]; signed ops take the sign from the key):

        op              magnitude m in [0, 1] means                               signed
        identity        (no magnitude)                                            -
        auto_contrast   (no magnitude) stretch each channel to span [0, 1]        -
        equalize        (no magnitude) per-channel histogram equalisation, 256    -
                        bins, PIL's ImageOps.equalize lookup table
        invert          (no magnitude) 1 - x; not in DEFAULT_OPS                  -
        rotate          angle 30 * m degrees, counter-clockwise for +             yes
        solarize        invert pixels >= threshold, threshold 256 * (1 - m) on    no
                        the 0..255 scale (m = 0: nothing, m = 1: everything)
        posterize       keep 8 - round(4 * m) bits (8 bits .. 4 bits)             no
        color           saturation: blend with the grey image, factor 1 +- 0.9 m yes
        contrast        blend with the mean grey level, factor 1 +- 0.9 m         yes
        brightness      blend with black, factor 1 +- 0.9 m                       yes
        sharpness       blend with PIL's 3x3 smoothing, factor 1 +- 0.9 m         yes
        shear_x         x_src = x + 0.3 m (y - y_centre)                          yes
        shear_y         y_src = y + 0.3 m (x - x_centre)                          yes
        translate_x     shift right by m * W / 3 pixels                           yes
        translate_y     shift down by m * H / 3 pixels                            yes

    The blend factors and the rotate / shear ranges are those of AutoAugment and RandAugment
    (factor in [0.1, 1.9], 30 degrees, shear 0.3). Translation is relative (up to a third of the
    image, about 10.7 pixels on CIFAR-10) rather than RandAugment's absolute pixels. The
    geometric ops share one helper, `affine_warp`: each output pixel is mapped back into the
    input image about the image centre and sampled bilinearly, with grey (`FILL_VALUE` = 0.5)
    outside. Colour ops follow PIL's ImageEnhance semantics (ITU-R 601 luma for grey), but work
    on floats, so results are not quantised to 1/255 except for posterize and equalize.

    Sources:

    - RandAugment: E. D. Cubuk, B. Zoph, J. Shlens, Q. V. Le, "RandAugment: Practical automated
      data augmentation with a reduced search space", 2019, arXiv:1909.13719. The op list above
      is the paper's 14 ops (plus invert); N = ``num_ops`` ops are drawn uniformly per image
      and all use one global magnitude M out of 10.
    - AutoAugment (op definitions and ranges): Cubuk et al., 2018, arXiv:1805.09501.

    Cost: under vmap, `lax.switch` with a per-example index evaluates every branch and selects,
    so one RandAugment layer costs the sum of all ops. `rand_augment` therefore warps once per
    op slot with the drawn geometric op's matrix (the five geometric ops would otherwise be five
    bilinear warps) and switches over the colour ops only. See
    ``benchmarks/probes/bench_randaugment.py``.
    """
    m = float(magnitude) / MAX_LEVEL
    branches = [lambda image, k, op=op: op(image, m, k) for op in ops]
    geometric = [op in _AFFINE for op in ops]
    one_warp = one_warp and sum(geometric) > 1
    if one_warp:  # geometric ops leave the image alone in the switch; the warp does them
        branches = [identity if g else b for b, g in zip(branches, geometric)]

    def one_image(image, example_id):
        example_key = jax.random.fold_in(key, example_id)
        for slot in range(num_ops):  # a loop over op slots, not over images
            slot_key = jax.random.fold_in(example_key, slot)
            image = _one_slot(image, slot_key, ops, branches, m, one_warp)
        return image

    return jax.vmap(one_image)(images, jnp.asarray(example_ids, jnp.int32))


def _one_slot(image, slot_key, ops, branches, m, one_warp):
    """One op slot of one image: an op drawn uniformly from `ops` and applied by
    `branches` (one per op, at magnitude m). With `one_warp` the geometric branches are
    the identity, and the drawn op's warp, if geometric, replaces the switch's result."""
    choice_key, op_key = jax.random.split(slot_key)
    index = jax.random.randint(choice_key, (), 0, len(ops))
    # Under vmap this switch becomes "evaluate all branches, select one".
    # JAX 0.10.2 pitfall: inside shard_map (check_vma=True), a vmapped switch fails
    # ("pvary is a invariant->variant collective") if a branch uses a constant array
    # such as jnp.asarray([0.299, 0.587, 0.114]); the ops here use scalars only.
    switched = lax.switch(index, branches, image, op_key)
    if one_warp:
        is_geometric = jnp.asarray([op in _AFFINE for op in ops])[index]
        switched = jnp.where(is_geometric, _drawn_warp(index, image, op_key, ops, m), switched)
    return switched


def _drawn_warp(index, image, op_key, ops, m):
    """The warp of op `index` of `ops` at magnitude m, or the identity if it is not
    geometric (then unused)."""
    affines = [_AFFINE[op](image.shape, m, op_key) if op in _AFFINE
               else (IDENTITY_MATRIX, (0.0, 0.0)) for op in ops]
    matrix = jnp.stack([jnp.asarray(a, jnp.float32) for a, _ in affines])[index]
    offset = jnp.stack([jnp.asarray(o, jnp.float32) for _, o in affines])[index]
    return affine_warp(image, matrix, offset)


__all__ = [
    "FILL_VALUE", "MAX_LEVEL", "DEFAULT_OPS", "ALL_OPS", "SIGNED_OPS",
    "bilinear_sample", "affine_warp", "rotation_matrix",
    "identity", "invert", "auto_contrast", "equalize", "rotate", "solarize", "posterize",
    "color", "contrast", "brightness", "sharpness", "shear_x", "shear_y", "translate_x",
    "translate_y", "rand_augment",
]
