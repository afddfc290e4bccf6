"""The kit's parameter tree as the importers build it, and fitting it to a model.

Every importer (bigvision.py, timm.py, hf.py) turns a file into the tree of
`model.init_params` (float32 numpy arrays, the encoder blocks stacked along a leading
layer axis) plus what the file says of the model (`Found`). `config_of` makes that a
ViTConfig; `fit` then makes the tree fit the model a run trains:

* every weight of the encoder must have the model's shape (width, depth, heads, MLP size,
  patch size): a difference is one line naming the key and both shapes;
* the position embedding is resampled (bilinear, as big_vision does) when the model's
  grid of patches differs from the file's (another resolution or patch count); a class
  token's row is kept as it is;
* the head is replaced by a zero-initialised one when the class count differs (or the
  file has no head), so the first step starts from the pretrained features with zero
  logits.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from vit_pure.config import ViTConfig
from vit_pure.errors import WeightsError
from vit_pure.model import init_params


@dataclasses.dataclass(frozen=True)
class Found:
    """What a file says of its model beyond the tree's shapes."""
    format: str            # "bigvision", "timm", "hf" or "kit"
    patch_size: int
    channels: int
    heads: int
    pool: str              # ViTConfig.pool
    gelu: str              # ViTConfig.gelu
    ln_eps: float
    inputs: str            # ViTConfig.inputs
    notes: tuple[str, ...] = ()  # one line each, said at start-up


def hwio_to_rows(kernel: np.ndarray) -> np.ndarray:
    """A patch embedding as a convolution kernel (p, p, C, E) -> the kit's (p*p*C, E),
    rows in the order `model.embed` flattens a patch (row, column, channel)."""
    p1, p2, c, e = kernel.shape
    return kernel.reshape(p1 * p2 * c, e)


def rows_to_hwio(kernel: np.ndarray, patch: int, channels: int) -> np.ndarray:
    return kernel.reshape(patch, patch, channels, kernel.shape[-1])


def grid_side(rows: int, what: str) -> int:
    side = math.isqrt(rows)
    if side * side != rows:
        raise WeightsError(f"{what}: {rows} positions is not a square grid")
    return side


def pos_rows(pos: np.ndarray, class_token: bool, key: str) -> np.ndarray:
    """A file's position embedding (1, rows, E) or (rows, E) -> the kit's (T, E): with a
    class token and a square number of rows (the class token's row not folded in, as
    big_vision's ViT adds the embedding before prepending the token), a zero row first."""
    pos = pos.reshape(-1, pos.shape[-1])
    n = pos.shape[0]
    if class_token and math.isqrt(n) ** 2 == n:
        return np.concatenate([np.zeros_like(pos[:1]), pos])
    grid_side(n - int(class_token), key)
    return pos


def config_of(params: dict, found: Found, name: str) -> ViTConfig:
    """The ViTConfig of an imported tree."""
    blocks = params["blocks"]
    depth, width, _, heads, _ = blocks["attn"]["qkv"]["kernel"].shape
    patches = params["pos_embed"].shape[0] - int(found.pool != "gap")
    grid = grid_side(patches, "pos_embed")
    head = params.get("head")
    return ViTConfig(
        name=name, image_size=grid * found.patch_size, patch_size=found.patch_size,
        num_classes=head["kernel"].shape[1] if head else 0, width=width, depth=depth,
        heads=heads, mlp_dim=blocks["mlp"]["fc1"]["kernel"].shape[2],
        channels=found.channels, pool=found.pool, gelu=found.gelu, ln_eps=found.ln_eps,
        inputs=found.inputs)


def expected_shapes(cfg: ViTConfig) -> dict:
    """The shapes of `init_params(key, cfg)`, as a tree of tuples."""
    tree = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    return jax.tree.map(lambda s: tuple(s.shape), tree)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _unflat(flat: dict) -> dict:
    tree: dict = {}
    for key, v in flat.items():
        node = tree
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def resample_pos_embed(pos: np.ndarray, class_token: bool, grid: int) -> np.ndarray:
    """(T, E) -> the same for a `grid` x `grid` patch grid: the patches' rows resized as
    an image (bilinear, `jax.image.resize`, as big_vision's `resample_posemb`), the class
    token's row kept."""
    head, patches = (pos[:1], pos[1:]) if class_token else (pos[:0], pos)
    side = grid_side(patches.shape[0], "pos_embed")
    image = patches.reshape(side, side, -1)
    resized = jax.image.resize(jnp.asarray(image), (grid, grid, image.shape[-1]), "bilinear")
    return np.concatenate([head, np.asarray(resized, np.float32).reshape(grid * grid, -1)])


def fit(params: dict, src: ViTConfig, cfg: ViTConfig, path: str) -> tuple[dict, list[str]]:
    """`params` (read from `path`, model `src`) made to fit `cfg`: (tree, notes), the notes
    one line each (resampled position embedding, new head). WeightsError names the first
    key that does not fit, with both shapes."""
    want = _flat(expected_shapes(cfg))
    have = _flat(params)
    notes = []
    if src.class_token != cfg.class_token:
        raise WeightsError(
            f"{path}: the file's model {'has' if src.class_token else 'has no'} class token; "
            f"--pool {cfg.pool} needs {'one' if cfg.class_token else 'none'}")
    extra = sorted(set(have) - set(want) - {"head/kernel", "head/bias"})
    if extra:
        raise WeightsError(f"{path}: {extra[0]} {have[extra[0]].shape} has no place in "
                           f"{cfg.name}")
    out = {}
    for key, shape in want.items():
        if key.startswith("head/"):
            continue
        if key not in have:
            raise WeightsError(f"{path}: no {key} in the file; {cfg.name} needs {shape}")
        a = np.asarray(have[key], np.float32)
        if key == "pos_embed" and a.shape != shape and a.shape[1:] == shape[1:]:
            before = grid_side(a.shape[0] - int(cfg.class_token), key)
            a = resample_pos_embed(a, cfg.class_token, grid_side(cfg.num_patches, key))
            side = math.isqrt(cfg.num_patches)
            notes.append(f"position embedding resampled from {before}x{before} to "
                         f"{side}x{side} patches (bilinear)")
        if a.shape != shape:
            raise WeightsError(f"{path}: {key} is {a.shape} in the file; {cfg.name} needs "
                               f"{shape}")
        out[key] = a
    head = params.get("head")
    if head is not None and head["kernel"].shape == want["head/kernel"]:
        out["head/kernel"] = np.asarray(head["kernel"], np.float32)
        out["head/bias"] = np.asarray(head["bias"], np.float32)
    else:
        out["head/kernel"] = np.zeros(want["head/kernel"], np.float32)
        out["head/bias"] = np.zeros(want["head/bias"], np.float32)
        had = f"the file's {head['kernel'].shape[1]}" if head is not None else "none in the file"
        notes.append(f"new head: {cfg.num_classes} classes, zero-initialised ({had})")
    return _unflat(out), notes
