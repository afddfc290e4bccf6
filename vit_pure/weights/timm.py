"""timm's VisionTransformer weights: a ``model.safetensors`` of its state dict (PyTorch
layouts), optionally with timm's Hub ``config.json`` beside it.

`read` / `state_dict_tree` map timm's key names (the table, and where the head count and
the input scaling come from: the comment above `NAME_HEADS`) into the kit's tree; `write`
writes a kit model as `timm.create_model` reads it.
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import numpy as np

from vit_pure.config import INPUT_SCALINGS, ViTConfig
from vit_pure.errors import WeightsError
from vit_pure.weights import safetensors
from vit_pure.weights.tree import Arrays, Found, pos_rows, rows_to_hwio

#     patch_embed.proj.weight (E, C, p, p)  patch_embed.proj.bias (E,)   a convolution, OIHW
#     cls_token (1, 1, E)                   pos_embed (1, T, E)          (class row included)
#     blocks.{i}.norm1.{weight,bias}        blocks.{i}.norm2.{weight,bias}
#     blocks.{i}.attn.qkv.weight (3E, E)    blocks.{i}.attn.qkv.bias (3E,)   rows (q|k|v, H, D)
#     blocks.{i}.attn.proj.weight (E, E)    blocks.{i}.attn.proj.bias (E,)
#     blocks.{i}.mlp.fc1.weight (M, E) ...  blocks.{i}.mlp.fc2.weight (E, M) ...
#     norm.{weight,bias}                    the final LayerNorm (class-token pooling), or
#     fc_norm.{weight,bias}                 after average pooling (global_pool "avg")
#     head.weight (K, E)                    head.bias (K,)
#
# A torch Linear's weight is (out, in): the kit's kernels are its transpose. The head count
# is not in the weights: it comes from config.json's model_args or architecture name, else
# from the caller (`--model`), else width / 64 (every ViT of the ViT and DeiT papers
# has 64-wide heads but ViT-H's 80). timm's ViTs use LayerNorm epsilon 1e-6 and the exact
# GELU unless config.json's model_args name another `act_layer`; the input scaling is
# config.json's pretrained_cfg mean / std when there is one, else
# [-1, 1] (the default of timm's `vit_*` models, which come from the AugReg release).
# timm model name stems -> heads (their widths' ViT variants).
# timm's act_layer names -> the kit's ViTConfig.gelu (timm's ViT default: "gelu").
ACT_LAYERS = {"gelu": "exact", "gelu_tanh": "tanh"}
NAME_HEADS = {"vit_tiny": 3, "vit_small": 6, "vit_medium": 8, "vit_base": 12, "vit_large": 16,
              "vit_huge": 16, "deit_tiny": 3, "deit_small": 6, "deit_base": 12}


def scaling_name(mean, std, source) -> str:
    """The INPUT_SCALINGS name of a (mean, std) pair that `source` (a file) gives; a
    WeightsError naming the file where the pair is none of them."""
    for name, (m, s) in INPUT_SCALINGS.items():
        if np.allclose(m, mean, atol=1e-3) and np.allclose(s, std, atol=1e-3):
            return name
    raise WeightsError(f"{source}: input mean / std {mean} / {std} is none of the kit's "
                       f"scalings ({', '.join(INPUT_SCALINGS)})")


def _config(path: pathlib.Path) -> dict:
    cfg_path = path.parent / "config.json"
    if not cfg_path.is_file():
        return {}
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{cfg_path}: not readable JSON ({e})") from None
    return cfg if isinstance(cfg, dict) and "architecture" in cfg else {}


def read(path: str | os.PathLike, heads: int | None = None) -> tuple[dict, Found]:
    """(the kit's tree, what the files say) of a timm ViT's model.safetensors."""
    path = pathlib.Path(path)
    arrays, _ = safetensors.read(path)
    return state_dict_tree(Arrays(arrays, path, " (not a timm VisionTransformer?)"), heads,
                           _config(path), path.parent / "config.json")


def state_dict_tree(w: Arrays, heads: int | None, hub: dict,
                    hub_path) -> tuple[dict, Found]:
    """(the kit's tree, what the arrays say) of a timm ViT's state dict (a safetensors
    file's, or an ONNX graph's initializers: onnx.py); `hub`: timm's Hub config.json."""
    path, get = w.where, w.get
    conv = get("patch_embed.proj.weight")  # (E, C, p, p)
    width, channels, patch = conv.shape[0], conv.shape[1], conv.shape[2]
    heads, notes = _heads(hub, heads, width, path)
    class_token = "cls_token" in w
    avg = "fc_norm.weight" in w
    if not avg and not class_token:
        raise WeightsError(f"{path}: average pooling without fc_norm (LayerNorm before the "
                           f"pool) is not a pooling the kit has")
    norm = "fc_norm" if avg else "norm"
    params = {
        "patch_embed": {"kernel": conv.transpose(2, 3, 1, 0).reshape(-1, width),
                        "bias": get("patch_embed.proj.bias")},
        **({"cls_token": get("cls_token").reshape(-1)} if class_token else {}),
        "pos_embed": get("pos_embed").reshape(-1, width),
        "blocks": _blocks(w, width, heads),
        "final_ln": {"scale": get(f"{norm}.weight"), "bias": get(f"{norm}.bias")},
    }
    if "head.weight" in w and get("head.weight").size:
        params["head"] = {"kernel": get("head.weight").T, "bias": get("head.bias")}
    w.skip("head.weight", "head.bias")
    if "reg_token" in w:  # register tokens, after the class token
        reg = get("reg_token").reshape(-1, width)
        pos, n = params["pos_embed"], int(class_token)
        patches = pos.shape[0] - n - len(reg)
        if patches > 0 and math.isqrt(patches) ** 2 == patches:
            # Position rows for the registers too (timm's embed_class): each register's
            # row is a constant added to it, folded into the token.
            reg = reg + pos[n:n + len(reg)]
            params["pos_embed"] = np.concatenate([pos[:n], pos[n + len(reg):]])
        params["reg_tokens"] = reg
    if class_token:  # no_embed_class: no class row (the kit's row is then zero)
        params["pos_embed"] = pos_rows(params["pos_embed"], True, "pos_embed")
    w.refuse_unread("the kit's ViT")
    pretrained = hub.get("pretrained_cfg", {})
    inputs = "minus1to1"
    if "mean" in pretrained and "std" in pretrained:
        inputs = scaling_name(pretrained["mean"], pretrained["std"], hub_path)
    pool = ("mean" if class_token else "gap") if avg else "cls"
    act = hub.get("model_args", {}).get("act_layer", "gelu")
    if act not in ACT_LAYERS:
        raise WeightsError(f"{hub_path}: act_layer {act!r} is none of the GELUs the kit has "
                           f"({', '.join(ACT_LAYERS)})")
    return params, Found(format="timm", patch_size=patch, channels=channels, heads=heads,
                         pool=pool, gelu=ACT_LAYERS[act], ln_eps=1e-6, inputs=inputs,
                         notes=tuple(notes), resample="timm")


def _heads(hub: dict, heads: int | None, width: int, path) -> tuple[int, list[str]]:
    """The head count: the file's own word first (then a --model of another head count
    fails to fit), else the caller's, else width / 64 (said in the note returned)."""
    notes = []
    heads = hub.get("model_args", {}).get("num_heads") or next(
        (h for stem, h in NAME_HEADS.items() if hub.get("architecture", "").startswith(stem)),
        None) or heads
    if not heads:
        heads = max(1, width // 64)
        notes.append(f"head count not in the file: assumed width / 64 = {heads}")
    if width % heads:
        raise WeightsError(f"{path}: width {width} does not split into {heads} heads")
    return heads, notes


def _blocks(w: Arrays, width: int, heads: int) -> dict:
    """The encoder blocks of a timm state dict, stacked along the kit's layer axis."""
    get, d = w.get, width // heads
    depth = 0
    while f"blocks.{depth}.norm1.weight" in w:
        depth += 1

    def stack(fmt, fn=lambda a: a):
        return np.stack([fn(get(fmt.format(i))) for i in range(depth)])

    blocks = {
        "ln1": {"scale": stack("blocks.{}.norm1.weight"), "bias": stack("blocks.{}.norm1.bias")},
        "attn": {
            "qkv": {"kernel": stack("blocks.{}.attn.qkv.weight",
                                    lambda a: a.T.reshape(width, 3, heads, d)),
                    "bias": stack("blocks.{}.attn.qkv.bias", lambda a: a.reshape(3, heads, d))},
            "out": {"kernel": stack("blocks.{}.attn.proj.weight",
                                    lambda a: a.T.reshape(heads, d, width)),
                    "bias": stack("blocks.{}.attn.proj.bias")},
        },
        "ln2": {"scale": stack("blocks.{}.norm2.weight"), "bias": stack("blocks.{}.norm2.bias")},
        "mlp": {"fc1": {"kernel": stack("blocks.{}.mlp.fc1.weight", np.transpose),
                        "bias": stack("blocks.{}.mlp.fc1.bias")},
                "fc2": {"kernel": stack("blocks.{}.mlp.fc2.weight", np.transpose),
                        "bias": stack("blocks.{}.mlp.fc2.bias")}},
    }
    if "blocks.0.ls1.gamma" in w:  # LayerScale (timm's init_values)
        for ls in ("ls1", "ls2"):
            blocks[ls] = {"gamma": stack(f"blocks.{{}}.{ls}.gamma")}
    return blocks


def write(directory: str | os.PathLike, cfg: ViTConfig, params: dict) -> list[pathlib.Path]:
    """timm's model.safetensors and Hub config.json for the kit's model `cfg` in
    `directory` (tools/export.py's docstring shows how timm builds the model from them)."""
    if cfg.stem or cfg.lsa or cfg.pool not in ("cls", "mean", "gap"):
        raise WeightsError(f"{cfg.name}: a convolutional stem, locality self-attention or "
                           f"pool {cfg.pool!r} has no timm VisionTransformer equivalent")
    if cfg.ln_eps != 1e-6:
        raise WeightsError(f"{cfg.name}: timm's ViT has LayerNorm epsilon 1e-6, the model "
                           f"{cfg.ln_eps}")
    E, H, D, L = cfg.width, cfg.heads, cfg.head_dim, cfg.depth
    b = params["blocks"]
    conv = rows_to_hwio(np.asarray(params["patch_embed"]["kernel"]), cfg.patch_size, cfg.channels)
    pos = np.asarray(params["pos_embed"])
    n = int(cfg.class_token)  # timm's position rows: class token, registers (zero), patches
    pos = np.concatenate([pos[:n], np.zeros((cfg.registers, E), pos.dtype), pos[n:]])
    w = {"patch_embed.proj.weight": conv.transpose(3, 2, 0, 1),
         "patch_embed.proj.bias": params["patch_embed"]["bias"],
         "pos_embed": pos[None],
         "head.weight": np.asarray(params["head"]["kernel"]).T,
         "head.bias": params["head"]["bias"]}
    if cfg.class_token:
        w["cls_token"] = np.asarray(params["cls_token"]).reshape(1, 1, E)
    if cfg.registers:
        w["reg_token"] = np.asarray(params["reg_tokens"])[None]
    norm = "norm" if cfg.pool == "cls" else "fc_norm"
    w[f"{norm}.weight"], w[f"{norm}.bias"] = params["final_ln"]["scale"], params["final_ln"]["bias"]
    for i in range(L):
        p = f"blocks.{i}."
        w[p + "norm1.weight"], w[p + "norm1.bias"] = b["ln1"]["scale"][i], b["ln1"]["bias"][i]
        w[p + "norm2.weight"], w[p + "norm2.bias"] = b["ln2"]["scale"][i], b["ln2"]["bias"][i]
        qkv = np.asarray(b["attn"]["qkv"]["kernel"][i])
        w[p + "attn.qkv.weight"] = qkv.reshape(E, 3 * E).T
        w[p + "attn.qkv.bias"] = np.asarray(b["attn"]["qkv"]["bias"][i]).reshape(-1)
        w[p + "attn.proj.weight"] = np.asarray(b["attn"]["out"]["kernel"][i]).reshape(H * D, E).T
        w[p + "attn.proj.bias"] = b["attn"]["out"]["bias"][i]
        for fc in ("fc1", "fc2"):
            w[p + f"mlp.{fc}.weight"] = np.asarray(b["mlp"][fc]["kernel"][i]).T
            w[p + f"mlp.{fc}.bias"] = b["mlp"][fc]["bias"][i]
        if cfg.layer_scale is not None:
            for ls in ("ls1", "ls2"):
                w[p + f"{ls}.gamma"] = b[ls]["gamma"][i]
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    mean, std = INPUT_SCALINGS[cfg.inputs]
    config = {
        # A registered model name: model_args give every shape (they override its own).
        "architecture": "vit_base_patch16_224",
        "num_classes": cfg.num_classes, "num_features": E,
        "global_pool": "token" if cfg.pool == "cls" else "avg",
        "model_args": {"img_size": cfg.image_size, "patch_size": cfg.patch_size,
                       "in_chans": cfg.channels, "embed_dim": E, "depth": L, "num_heads": H,
                       "mlp_ratio": cfg.mlp_dim / E, "class_token": cfg.class_token,
                       "global_pool": "token" if cfg.pool == "cls" else "avg",
                       "fc_norm": cfg.pool != "cls", "num_classes": cfg.num_classes,
                       "act_layer": next(k for k, v in ACT_LAYERS.items() if v == cfg.gelu),
                       **({"init_values": cfg.layer_scale} if cfg.layer_scale else {}),
                       **({"reg_tokens": cfg.registers} if cfg.registers else {})},
        "pretrained_cfg": {"input_size": [cfg.channels, cfg.image_size, cfg.image_size],
                           "mean": list(mean), "std": list(std), "crop_pct": 1.0,
                           "interpolation": "bilinear", "num_classes": cfg.num_classes,
                           "classifier": "head", "first_conv": "patch_embed.proj"},
    }
    safetensors.write(directory / "model.safetensors", w, {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [directory / "model.safetensors", directory / "config.json"]

