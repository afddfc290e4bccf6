"""Dropout and stochastic depth (`dropout`, `drop_path`), their masks drawn per example
(the --dropout-masks flag).

Every mask comes from `fold_in(rng, example_id)` (`example_keys`), then the layer and the
site (`site_keys`): it belongs to the example, not to the device holding it. `keep_mask`
draws one example's mask in one of two ways with the same distribution.

On accelerators (`Execution.packed_masks`) a mask is drawn or `pack`ed eight elements to a
byte (`keep_bytes`) and `apply_mask` keeps it so for the backward pass, unpacking it in
both: a bool mask is a byte an element, as many bytes as a bf16 activation has elements,
written once and read twice per dropout site.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.random import threefry2x32_p

from vit_pure.layers.remat import MASK


def example_keys(rng, example_ids):
    """One key per example, from its global index in the batch: (B,) keys."""
    return jax.vmap(lambda i: jax.random.fold_in(rng, i))(example_ids)


def site_keys(ex_keys, layer, site):
    """Each example's key for one dropout site of one layer: (B,) keys."""
    return jax.vmap(lambda k: jax.random.fold_in(jax.random.fold_in(k, layer), site))(ex_keys)


def keep_probability(rate: float, masks: str) -> float:
    """The probability that `keep_mask` keeps an element: 1 - rate, or for "threefry16"
    1 - rate rounded to a multiple of 2^-16 (0.1 -> keep 58982 / 65536 = 0.899994)."""
    if masks == "bernoulli":
        return 1.0 - rate
    return max(1, round((1.0 - rate) * 65536)) / 65536


def keep_mask(key, shape, rate: float, masks: str):
    """One example's dropout mask (True: keep) of `shape`, drawn from its `key`.

    "bernoulli": `jax.random.bernoulli`, a float32 uniform per element; JAX's Threefry
    (partitionable, its default) spends one 2x32 hash on each element.
    "threefry16": 16-bit uniforms, four per hash, a quarter of the hashes: the mask
    `keep_bytes` draws packed, unpacked.
    Either way the mask depends only on the example's key, not on the batch around it.
    """
    if masks == "bernoulli":
        return jax.random.bernoulli(key, 1.0 - rate, shape)
    n = math.prod(shape)
    return unpack(keep_bytes(key, -(-n // 8), rate, masks))[:n].reshape(shape)


def keep_bytes(key, nbytes: int, rate: float, masks: str):
    """One example's first 8 x `nbytes` mask elements, `pack`ed: (nbytes,) uint8, the
    elements `keep_mask` draws.

    "threefry16" draws them packed: byte j holds elements 8j to 8j + 7, the eight 16-bit
    halves of the four 32-bit words that the Threefry 2x32 hash (`threefry2x32_p`) gives
    for the counter pairs (j, 0) and (j, 1), each compared with the keep probability in
    units of 2^-16 (`keep_probability`). Every byte is a function of its index alone, so
    XLA draws it inside the kernel that uses it and the hashes' words are never written
    out (docs/performance.md, "Dropout masks on a CPU" and "The memory-bound
    passes"). "bernoulli" packs `keep_mask`'s bools.
    """
    if masks == "bernoulli":
        return pack(keep_mask(key, (8 * nbytes,), rate, masks))
    k1, k2 = (k.reshape(1) for k in jax.random.key_data(key))
    j = jnp.arange(nbytes, dtype=jnp.uint32)
    below = round(keep_probability(rate, masks) * 65536)
    byte = jnp.zeros(nbytes, jnp.uint8)
    for pair in range(2):
        w1, w2 = threefry2x32_p.bind(k1, k2, j, jnp.full_like(j, pair))
        for h, half in enumerate((w1 & 0xFFFF, w1 >> 16, w2 & 0xFFFF, w2 >> 16)):
            byte = byte | ((half < below).astype(jnp.uint8) << (4 * pair + h))
    return byte


def pack(keep):
    """A mask (..., n) of bools, n a multiple of 8 -> (..., n // 8) uint8: element i of a
    row in bit i % 8 of byte i // 8, so rows stay rows."""
    bits = keep.reshape(*keep.shape[:-1], -1, 8).astype(jnp.uint8)
    return jnp.sum(bits << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack(packed):
    """The inverse of `pack`: (..., n // 8) uint8 -> (..., n) bools."""
    bits = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    return bits.reshape(*packed.shape[:-1], -1).astype(bool)


def _kept(mask):
    return unpack(mask) if mask.dtype == jnp.uint8 else mask


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def apply_mask(x, mask, keep_prob: float):
    """Dropout: x where the mask keeps it, divided by `keep_prob`, else 0, in x's dtype.
    `mask`: bools of x's shape, or those bools `pack`ed (uint8, along x's last axis).

    A custom VJP so that the backward pass reads the mask as it was given: autodiff of
    the `where` would keep the unpacked bools for it."""
    return jnp.where(_kept(mask), x / keep_prob, 0).astype(x.dtype)


def _apply_mask_fwd(x, mask, keep_prob):
    return apply_mask(x, mask, keep_prob), mask


def _apply_mask_bwd(keep_prob, mask, dy):
    # The same values as autodiff's where(keep, dy, 0) / keep_prob.
    return jnp.where(_kept(mask), dy / keep_prob, 0).astype(dy.dtype), None


apply_mask.defvjp(_apply_mask_fwd, _apply_mask_bwd)


def dropout(x, rate, ex_keys, layer, site, masks="bernoulli", packed=True):
    """Dropout on x (B, T, E) or (B*T, E): each example's elements lie together, and its
    mask over them (x.size / B, drawn as one flat vector) comes from its own key. With
    `packed` (`Execution.packed_masks`) the mask is kept eight elements a byte along E,
    when E is a multiple of 8."""
    if ex_keys is None or rate == 0.0:
        return x
    keys = site_keys(ex_keys, layer, site)
    per_example = x.size // keys.shape[0]
    if packed and x.shape[-1] % 8 == 0:  # each example's bytes, as rows of E / 8
        keep = jax.vmap(lambda k: keep_bytes(k, per_example // 8, rate, masks))(keys)
        keep = keep.reshape(*x.shape[:-1], -1)
    else:
        keep = jax.vmap(lambda k: keep_mask(k, (per_example,), rate, masks))(keys)
        keep = keep.reshape(x.shape)
    return apply_mask(x, checkpoint_name(keep, MASK), keep_probability(rate, masks))


def drop_path(x, rate, ex_keys, layer, site):
    """Stochastic depth: zero the whole residual branch x (B*T, E) for some examples."""
    if ex_keys is None:
        return x
    keys = site_keys(ex_keys, layer, site)
    keep = checkpoint_name(jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate))(keys), MASK)
    keep = jnp.repeat(keep, x.shape[0] // keep.shape[0])  # (B*T,): each token its example's
    return jnp.where(keep[:, None], x / (1.0 - rate), 0).astype(x.dtype)

