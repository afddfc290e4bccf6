"""big_vision / vision_transformer (AugReg) checkpoints: an ``.npz`` of flat Flax paths.

The keys are the Flax parameter paths joined with ``/``, under one of `PREFIXES` (the
release's key table: the comment above it). `read` maps them into the kit's tree and says
what such a model assumes and what is refused; `arrays` writes the kit's tree back as such
keys.
"""
from __future__ import annotations

import os
import zipfile

import numpy as np

from vit_pure.errors import WeightsError
from vit_pure.weights.tree import Arrays, Found, hwio_to_rows, pos_rows, rows_to_hwio

# The keys are the Flax parameter paths joined with ``/``, under one of the prefixes ""
# (google-research/vision_transformer and the AugReg release), "opt/target/" (older Flax
# optimizer checkpoints) or "params/" / "params/img/" (big_vision, alone or as the image
# tower of a two-tower model):
#
#     embedding/kernel (p, p, C, E)  embedding/bias (E,)      the patch embedding, HWIO
#     cls (1, 1, E)                                          (no class token: none)
#     Transformer/posembed_input/pos_embedding (1, T, E)     vision_transformer / AugReg
#     Transformer/pos_embedding (1, T, E)                    big_vision before 2022
#     pos_embedding (1, N, E)                                big_vision's ViT
#     Transformer/encoderblock_{i}/LayerNorm_0/{scale,bias}  ... LayerNorm_{n}/{scale,bias}
#     Transformer/encoderblock_{i}/MultiHeadDotProductAttention_{a}/{query,key,value}/kernel
#         (E, H, D), .../bias (H, D); .../out/kernel (H, D, E), .../out/bias (E,)
#     Transformer/encoderblock_{i}/MlpBlock_{m}/Dense_0/kernel (E, M) ... Dense_1 (M, E)
#     Transformer/encoder_norm/{scale,bias}
#     head/kernel (E, K)  head/bias (K,)                     (pre_logits/...: dropped)
#
# with (a, n, m) = (1, 2, 3) in vision_transformer's numbering and (0, 1, 0) in big_vision's;
# a scanned model stores one ``Transformer/encoderblock/...`` with a leading layer axis.
# The position embedding may have the class token's row (T = N + 1) or not (N rows: the
# kit's row is then zero). What such a model assumes and what is refused: `read`.
PREFIXES = ("", "opt/target/", "params/", "params/img/")
# Where the position embedding sits: vision_transformer / AugReg; big_vision's "widely
# used version before 2022" (its vit.py `fix_old_checkpoints`); big_vision's ViT.
POS_KEYS = ("Transformer/posembed_input/pos_embedding", "Transformer/pos_embedding",
            "pos_embedding")
_NUMBERING = {"vision_transformer": (1, 2, 3), "big_vision": (0, 1, 0)}
_ZIP_MAGIC = b"PK\x03\x04"


def is_npz(path) -> bool:
    """A zip archive by its first bytes (a truncated one too: its directory is at the end,
    so `zipfile.is_zipfile` calls it no zip)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _ZIP_MAGIC
    except OSError:
        return False


def _float32(a: np.ndarray) -> np.ndarray:
    """An array of the file as float32: bfloat16 arrays (saved from JAX, their dtype
    recorded as two raw bytes, "V2") widened exactly."""
    if a.dtype.kind == "V" and a.dtype.itemsize == 2:
        return (a.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, np.float32)


def read(path: str | os.PathLike) -> tuple[dict, Found]:
    """(the kit's tree, what the file says) of a big_vision-style .npz. Tanh GELU,
    LayerNorm epsilon 1e-6, inputs in [-1, 1]; bfloat16 arrays are widened; every array
    under the prefix must find its place. Models without a class token are refused
    (big_vision's "gap" averages after the final LayerNorm)."""
    w, prefix = _under_prefix(path, _load(path))
    stack, numbering = _block_stacker(path, w)
    a, n, m = _NUMBERING[numbering]
    mha, ln2, mlp = f"MultiHeadDotProductAttention_{a}/", f"LayerNorm_{n}/", f"MlpBlock_{m}/"
    qkv = [stack(f"{mha}{x}/kernel") for x in ("query", "key", "value")]  # (L, E, H, D)
    pos_key = _pos_key(path, w)
    kernel = w.get("embedding/kernel")
    params = {
        "patch_embed": {"kernel": hwio_to_rows(kernel), "bias": w.get("embedding/bias")},
        "cls_token": w.get("cls").reshape(-1),
        "pos_embed": pos_rows(w.get(pos_key), True, prefix + pos_key),
        "blocks": _blocks(stack, qkv, mha, ln2, mlp),
        "final_ln": {"scale": w.get("Transformer/encoder_norm/scale"),
                     "bias": w.get("Transformer/encoder_norm/bias")},
    }
    notes = []
    if "pre_logits/kernel" in w:  # vision_transformer's ImageNet-21k models: dropped
        w.skip("pre_logits/kernel", "pre_logits/bias", "head/kernel", "head/bias")
        notes.append("pre_logits dropped (as vision_transformer does to fine-tune); its "
                     "head then needs replacing")
    elif "head/kernel" in w:
        params["head"] = {"kernel": w.get("head/kernel"), "bias": w.get("head/bias")}
    w.refuse_unread(f"a big_vision ViT ({numbering} numbering)")
    found = Found(format="bigvision", patch_size=kernel.shape[0], channels=kernel.shape[2],
                  heads=qkv[0].shape[2], pool="cls", gelu="tanh",
                  ln_eps=1e-6, inputs="minus1to1", notes=tuple(notes), resample="bigvision")
    return params, found


def _load(path) -> dict[str, np.ndarray]:
    """Every array of the .npz, as float32; a clear error for a file that is none."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: _float32(f[k]) for k in f.files}
    except zipfile.BadZipFile as e:
        raise WeightsError(f"{path}: a damaged or truncated .npz (zip archive: {e})") from None
    except (OSError, ValueError, EOFError) as e:
        raise WeightsError(f"{path}: not a readable .npz ({e})") from None


def _under_prefix(path, arrays: dict) -> tuple[Arrays, str]:
    """(the arrays under the first of `PREFIXES` that holds a ViT's embedding/kernel, keyed
    without it; that prefix). A model with an attention-pooling head is refused."""
    prefix = next((p for p in PREFIXES if f"{p}embedding/kernel" in arrays), None)
    if prefix is None:
        raise WeightsError(f"{path}: no embedding/kernel under any of the prefixes "
                           f"{', '.join(repr(p) for p in PREFIXES)}: not a ViT checkpoint of "
                           f"big_vision or vision_transformer")
    w = Arrays({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}, path,
               f" (under the prefix {prefix!r})" if prefix else "")
    if any(k.startswith("MAPHead") for k in w.arrays):
        raise WeightsError(f"{path}: an attention-pooling head (MAPHead, big_vision's pool "
                           f"\"map\") is not a head the kit has (its pools: cls, mean, gap)")
    return w, prefix


def _block_stacker(path, w: Arrays):
    """(stack, numbering): `stack(key)` is the array `key` of every encoder block stacked
    on a leading layer axis (one scanned block's as stored, or encoderblock_0, _1, ...
    stacked); `numbering` names the file's module numbering (a key of `_NUMBERING`)."""
    scanned = "Transformer/encoderblock/LayerNorm_0/scale" in w
    depth = (w.arrays["Transformer/encoderblock/LayerNorm_0/scale"].shape[0] if scanned else
             next(i for i in range(1 << 16)
                  if f"Transformer/encoderblock_{i}/LayerNorm_0/scale" not in w))
    if not depth:
        raise WeightsError(f"{path}: no Transformer/encoderblock_0/ (nor a scanned "
                           f"Transformer/encoderblock/) in the file")
    first = "Transformer/encoderblock/" if scanned else "Transformer/encoderblock_0/"
    numbering = ("vision_transformer" if f"{first}MultiHeadDotProductAttention_1/query/kernel"
                 in w else "big_vision")

    def stack(key):
        if scanned:
            return w.get(f"Transformer/encoderblock/{key}")
        return np.stack([w.get(f"Transformer/encoderblock_{i}/{key}") for i in range(depth)])
    return stack, numbering


def _pos_key(path, w: Arrays) -> str:
    """Where the file keeps its learned position embedding; a model without a class token
    or without a learned position embedding is refused."""
    if "cls" not in w:
        raise WeightsError(f"{path}: no class token (cls): big_vision's pool \"gap\" (the "
                           f"mean after the final LayerNorm; the kit's gap takes it before) "
                           f"or \"0\" (the first patch token) is not a head the kit has")
    pos_key = next((k for k in POS_KEYS if k in w), None)
    if pos_key is None:
        raise WeightsError(f"{path}: no learned position embedding ({' or '.join(POS_KEYS)}): "
                           f"big_vision's posemb \"sincos2d\" is computed, not stored, and the "
                           f"kit's ViT has only a learned one")
    return pos_key


def _blocks(stack, qkv: list, mha: str, ln2: str, mlp: str) -> dict:
    """The kit's stacked encoder blocks: `qkv` the query, key and value kernels already
    stacked, `mha`, `ln2` and `mlp` the file's module names (with their numbering)."""
    return {
        "ln1": {"scale": stack("LayerNorm_0/scale"), "bias": stack("LayerNorm_0/bias")},
        "attn": {
            "qkv": {"kernel": np.stack(qkv, axis=2),
                    "bias": np.stack([stack(f"{mha}{x}/bias")
                                      for x in ("query", "key", "value")], axis=1)},
            "out": {"kernel": stack(f"{mha}out/kernel"), "bias": stack(f"{mha}out/bias")},
        },
        "ln2": {"scale": stack(f"{ln2}scale"), "bias": stack(f"{ln2}bias")},
        "mlp": {"fc1": {"kernel": stack(f"{mlp}Dense_0/kernel"),
                        "bias": stack(f"{mlp}Dense_0/bias")},
                "fc2": {"kernel": stack(f"{mlp}Dense_1/kernel"),
                        "bias": stack(f"{mlp}Dense_1/bias")}},
    }


def arrays(params: dict, patch: int, channels: int, *, prefix: str = "",
           numbering: str = "vision_transformer", pos_key: str = POS_KEYS[0],
           class_row: bool = True, scanned: bool = False) -> dict[str, np.ndarray]:
    """The kit's tree as a big_vision-style .npz's arrays (`np.savez(path, **arrays)`), in
    any of the layouts `read` takes: `prefix`, the block `numbering`, where the position
    embedding goes (`pos_key`), whether it keeps the class token's row (`class_row`; the
    row must then be zero to drop it), one `scanned` block with a leading layer axis."""
    a, n, m = _NUMBERING[numbering]
    b = params["blocks"]
    layer = {
        "LayerNorm_0/scale": b["ln1"]["scale"], "LayerNorm_0/bias": b["ln1"]["bias"],
        f"LayerNorm_{n}/scale": b["ln2"]["scale"], f"LayerNorm_{n}/bias": b["ln2"]["bias"],
        f"MultiHeadDotProductAttention_{a}/out/kernel": b["attn"]["out"]["kernel"],
        f"MultiHeadDotProductAttention_{a}/out/bias": b["attn"]["out"]["bias"],
        f"MlpBlock_{m}/Dense_0/kernel": b["mlp"]["fc1"]["kernel"],
        f"MlpBlock_{m}/Dense_0/bias": b["mlp"]["fc1"]["bias"],
        f"MlpBlock_{m}/Dense_1/kernel": b["mlp"]["fc2"]["kernel"],
        f"MlpBlock_{m}/Dense_1/bias": b["mlp"]["fc2"]["bias"],
    }
    for j, x in enumerate(("query", "key", "value")):
        layer[f"MultiHeadDotProductAttention_{a}/{x}/kernel"] = b["attn"]["qkv"]["kernel"][:, :, j]
        layer[f"MultiHeadDotProductAttention_{a}/{x}/bias"] = b["attn"]["qkv"]["bias"][:, j]
    out = {"embedding/kernel": rows_to_hwio(np.asarray(params["patch_embed"]["kernel"]), patch,
                                            channels),
           "embedding/bias": params["patch_embed"]["bias"],
           "Transformer/encoder_norm/scale": params["final_ln"]["scale"],
           "Transformer/encoder_norm/bias": params["final_ln"]["bias"]}
    pos = np.asarray(params["pos_embed"])
    if "cls_token" in params:
        out["cls"] = np.asarray(params["cls_token"]).reshape(1, 1, -1)
        if not class_row:
            if np.any(pos[0]):
                raise ValueError("the class token's position row is not zero: keep it")
            pos = pos[1:]
    out[pos_key] = pos[None]
    if "head" in params:
        out["head/kernel"], out["head/bias"] = params["head"]["kernel"], params["head"]["bias"]
    for k, v in layer.items():
        v = np.asarray(v)
        if scanned:
            out[f"Transformer/encoderblock/{k}"] = v
        else:
            for i in range(v.shape[0]):
                out[f"Transformer/encoderblock_{i}/{k}"] = v[i]
    return {prefix + k: np.asarray(v, np.float32) for k, v in out.items()}
