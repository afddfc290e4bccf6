"""The kit's parameter tree as the importers build it, and fitting it to a model.

Every importer (bigvision.py, timm.py, hf.py) turns a file into the tree of
`model.init_params` (float32 numpy arrays, the encoder blocks stacked along a leading
layer axis) plus what the file says of the model (`Found`). `config_of` makes that a
ViTConfig; `fit` then makes the tree fit the model a run trains:

* every weight of the encoder must have the model's shape (width, depth, heads, MLP size,
  patch size): a difference is one line naming the key and both shapes;
* the position embedding is resampled as the file's own library does it (`RESAMPLERS`)
  when the model's grid of patches differs from the file's; a class token's row is kept;
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
    resample: str = "kit"  # how the file's library resizes the position embedding: RESAMPLERS


class Arrays:
    """A file's arrays by name, for a reader that takes each of them once: `get` names a
    key the file lacks, `refuse_unread` every key no `get` (nor `skip`) took, so that no
    weight of the file is silently left out of the model (layer scale, registers, ...)."""

    def __init__(self, arrays: dict, where, hint: str = ""):
        self.arrays, self.where, self.hint, self.read = arrays, where, hint, set()

    def __contains__(self, key) -> bool:
        return key in self.arrays

    def get(self, key: str) -> np.ndarray:
        if key not in self.arrays:
            raise WeightsError(f"{self.where}: no {key} in the file{self.hint}")
        self.read.add(key)
        return self.arrays[key]

    def skip(self, *keys: str) -> None:
        """Keys read on purpose into nothing (a pooler, an empty head)."""
        self.read.update(keys)

    def refuse_unread(self, model: str) -> None:
        extra = sorted(set(self.arrays) - self.read)
        if extra:
            shown = ", ".join(f"{k} {tuple(self.arrays[k].shape)}" for k in extra[:3])
            more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
            raise WeightsError(f"{self.where}: {len(extra)} array(s) {model} has no place "
                               f"for: {shown}{more}")


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
        inputs=found.inputs,
        # The gains' start value: a file's own gains replace it (1.0, "no change").
        layer_scale=1.0 if "ls1" in blocks else None,
        registers=params["reg_tokens"].shape[0] if "reg_tokens" in params else 0)


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


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with parameter a (torch and ONNX: -0.75; PIL and
    torch's antialiased path: -0.5)."""
    x = np.abs(x)
    return np.where(x <= 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))


def _matrix(n_in: int, n_out: int, method: str) -> np.ndarray:
    """The (n_out, n_in) matrix that resizes one axis of a grid by `method`."""
    m = np.zeros((n_out, n_in))
    out = np.arange(n_out)
    if method == "bigvision":  # scipy.ndimage.zoom(order=1): the corners aligned
        src = out * ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
        lo = np.minimum(np.floor(src).astype(int), n_in - 1)
        hi, t = np.minimum(lo + 1, n_in - 1), src - lo
        np.add.at(m, (out, lo), 1 - t)
        np.add.at(m, (out, hi), t)
    elif method == "torch-bicubic":  # F.interpolate(mode="bicubic", align_corners=False)
        src = (out + 0.5) * (n_in / n_out) - 0.5  # half-pixel centres, not clamped
        lo = np.floor(src).astype(int)
        for k in range(-1, 3):
            np.add.at(m, (out, np.clip(lo + k, 0, n_in - 1)), _cubic(src - (lo + k), -0.75))
    elif method == "torch-bicubic-aa":  # the same with antialias=True (PIL's filter)
        scale = n_in / n_out
        support, stretch = 2.0 * max(scale, 1.0), max(scale, 1.0)
        for i in out:
            centre = scale * (i + 0.5)
            lo = max(int(centre - support + 0.5), 0)
            hi = min(int(centre + support + 0.5), n_in)
            w = _cubic((np.arange(lo, hi) - centre + 0.5) / stretch, -0.5)
            m[i, lo:hi] = w / w.sum()
    else:
        raise ValueError(f"unknown resampling {method!r}")
    return m


# How each library resizes a position embedding to another grid of patches, in the file's
# own terms (big_vision's models/vit.py `resample_posemb`; timm's layers/pos_embed.py
# `resample_abs_pos_embed` as its ViT's checkpoint filter calls it; transformers'
# ViT / DINOv2 `interpolate_pos_encoding`, also what their ONNX graphs compute).
RESAMPLERS = {
    "kit": "bilinear",  # jax.image.resize: half-pixel, antialiased when shrinking
    "bigvision": "bilinear, corners aligned (big_vision: scipy.ndimage.zoom, order 1)",
    "timm": "bicubic, antialiased (timm: F.interpolate bicubic, antialias=True)",
    "hf": "bicubic (transformers: F.interpolate bicubic, align_corners=False)",
    "hf-antialias": "bicubic, antialiased (transformers' DINOv2 with registers)",
}
_METHODS = {"bigvision": "bigvision", "timm": "torch-bicubic-aa", "hf": "torch-bicubic",
            "hf-antialias": "torch-bicubic-aa"}


def resample_grid(image: np.ndarray, grid: int, method: str) -> np.ndarray:
    """(side, side, E) -> (grid, grid, E) by one of RESAMPLERS."""
    if method == "kit":
        return np.asarray(jax.image.resize(jnp.asarray(image), (grid, grid, image.shape[-1]),
                                           "bilinear"), np.float32)
    m = _matrix(image.shape[0], grid, _METHODS[method])
    out = np.einsum("ij,kl,jle->ike", m, m, image.astype(np.float64))
    return out.astype(np.float32)


def resample_pos_embed(pos: np.ndarray, class_token: bool, grid: int,
                       method: str = "kit") -> np.ndarray:
    """(T, E) -> the same for a `grid` x `grid` patch grid: the patches' rows resized as
    an image (`method`, one of RESAMPLERS), the class token's row kept."""
    head, patches = (pos[:1], pos[1:]) if class_token else (pos[:0], pos)
    side = grid_side(patches.shape[0], "pos_embed")
    resized = resample_grid(patches.reshape(side, side, -1), grid, method)
    return np.concatenate([head, resized.reshape(grid * grid, -1)])


def fit(params: dict, src: ViTConfig, cfg: ViTConfig, path: str,
        resample: str = "kit") -> tuple[dict, list[str]]:
    """`params` (read from `path`, model `src`) made to fit `cfg`: (tree, notes), the notes
    one line each (resampled position embedding, new head). `resample`: how, one of
    RESAMPLERS (the file's library: `Found.resample`). WeightsError names the first key
    that does not fit, with both shapes."""
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
            a = resample_pos_embed(a, cfg.class_token, grid_side(cfg.num_patches, key),
                                   resample)
            side = math.isqrt(cfg.num_patches)
            notes.append(f"position embedding resampled from {before}x{before} to "
                         f"{side}x{side} patches ({RESAMPLERS[resample]})")
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
