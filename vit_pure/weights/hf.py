"""Hugging Face transformers' ViT: ``model.safetensors`` + ``config.json`` (+ the optional
``preprocessor_config.json``) in one folder, as `save_pretrained` writes them.

`read` / `state_dict_tree` map the Hub's key names (transformers 4 and 5, ViT and DINOv2;
the table: the comment above `GELUS`) into the kit's tree, with the head count, GELU,
LayerNorm epsilon and input scaling from the JSON files; `write` writes a kit model as
`ViTForImageClassification` (pool cls) or `Dinov2ForImageClassification` (pool cls+mean)
reads it.
"""
from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np

from vit_pure.config import INPUT_SCALINGS, ViTConfig
from vit_pure.data.cifar10 import CIFAR10_CLASSES
from vit_pure.errors import WeightsError
from vit_pure.weights import safetensors
from vit_pure.weights.timm import scaling_name
from vit_pure.weights.tree import Arrays, Found, rows_to_hwio

# Key names as the Hub's checkpoints have them (transformers 4; transformers 5 reads them
# and writes the names in brackets, which are read too):
#
#     vit.embeddings.cls_token (1, 1, E)     vit.embeddings.position_embeddings (1, T, E)
#     vit.embeddings.patch_embeddings.projection.{weight (E, C, p, p), bias}
#     vit.encoder.layer.{i}.  (vit.layers.{i}.)
#         layernorm_before / layernorm_after .{weight,bias}
#         attention.attention.{query,key,value}.{weight (E, E), bias}   (attention.{q,k,v}_proj)
#         attention.output.dense.{weight,bias}                          (attention.o_proj)
#         intermediate.dense.{weight (M, E), bias}                      (mlp.fc1)
#         output.dense.{weight (E, M), bias}                            (mlp.fc2)
#     vit.layernorm.{weight,bias}            classifier.{weight (K, E), bias}
#
# A `ViTModel` has no "vit." prefix and no classifier (its pooler is left out). DINOv2
# ("dinov2." or none) names norm1 / norm2 for layernorm_before / after, mlp.fc1 / fc2, adds
# layer_scale{1,2}.lambda1 (LayerScale), embeddings.register_tokens (with registers) and a
# classifier on the class token and the mean patch token (2E, pool "cls+mean"). config.json
# gives the head count, `hidden_act` ("gelu" exact, "gelu_pytorch_tanh" / "gelu_new" tanh),
# `layer_norm_eps` (1e-12 by default); preprocessor_config.json's image_mean / std the input
# scaling (without it, [-1, 1] for a ViT, ImageNet's for DINOv2). The writer folds a layer
# scale into the output projection and fc2 (exact): ViTForImageClassification has none.
GELUS = {"gelu": "exact", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh",
         "gelu_fast": "tanh"}
# transformers 5's names -> transformers 4's (the Hub's), which the reader takes.
_V5 = [(r"^vit\.layers\.", "vit.encoder.layer."),
       (r"\.attention\.q_proj\.", ".attention.attention.query."),
       (r"\.attention\.k_proj\.", ".attention.attention.key."),
       (r"\.attention\.v_proj\.", ".attention.attention.value."),
       (r"\.attention\.o_proj\.", ".attention.output.dense."),
       (r"\.mlp\.fc1\.", ".intermediate.dense."), (r"\.mlp\.fc2\.", ".output.dense.")]
# DINOv2's names (Dinov2Model, Dinov2WithRegistersModel) -> the ViT's.
_DINOV2 = [(r"(layer\.\d+)\.norm1\.", r"\1.layernorm_before."),
           (r"(layer\.\d+)\.norm2\.", r"\1.layernorm_after.")]


MODEL_TYPES = ("vit", "dinov2", "dinov2_with_registers")  # config.json's model_type


def is_hf_config(path: pathlib.Path) -> bool:
    """Whether `path` is a transformers ViT (or DINOv2) config.json."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") in MODEL_TYPES


def _json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: not readable JSON ({e})") from None


def canonical_names(raw: dict) -> dict:
    """A transformers ViT or DINOv2 state dict under the names the reader takes: the ViT's
    of transformers 4, with a "vit." prefix (DINOv2's "dinov2." becomes it)."""
    w = {}
    for k, v in raw.items():
        k = re.sub(r"^dinov2\.", "vit.", k)
        k = k if k.startswith(("vit.", "classifier.")) else "vit." + k
        for pattern, repl in _V5 + _DINOV2:
            k = re.sub(pattern, repl, k)
        w[k] = v
    return w


def read(path: str | os.PathLike) -> tuple[dict, Found]:
    """(the kit's tree, what the files say) of a folder (or its model.safetensors)."""
    path = pathlib.Path(path)
    folder = path if path.is_dir() else path.parent
    weights = path if path.is_file() else folder / "model.safetensors"
    config = _json(folder / "config.json")
    raw, _ = safetensors.read(weights)
    inputs = "imagenet" if config.get("model_type", "vit") != "vit" else "minus1to1"
    pre = folder / "preprocessor_config.json"
    if pre.is_file():
        p = _json(pre)
        if "image_mean" in p and "image_std" in p:
            inputs = scaling_name(p["image_mean"], p["image_std"], pre)
    return state_dict_tree(Arrays(canonical_names(raw), weights), config,
                           folder / "config.json", inputs)


def state_dict_tree(w: Arrays, config: dict, config_path, inputs: str,
                    notes: tuple[str, ...] = ()) -> tuple[dict, Found]:
    """(the kit's tree, what the arrays say) of a transformers ViT / DINOv2 state dict
    under `canonical_names` (a safetensors file's, or an ONNX graph's: onnx.py), with the
    model's config.json (hidden_size, num_hidden_layers, num_attention_heads, hidden_act,
    layer_norm_eps)."""
    get = w.get
    try:
        E, L, H = (int(config[k]) for k in ("hidden_size", "num_hidden_layers",
                                           "num_attention_heads"))
    except (KeyError, TypeError, ValueError):
        raise WeightsError(f"{config_path}: no hidden_size, num_hidden_layers and "
                           f"num_attention_heads") from None
    act = config.get("hidden_act", "gelu")
    if act not in GELUS:
        raise WeightsError(f"{config_path}: hidden_act {act!r} is not a GELU the "
                           f"kit has ({', '.join(GELUS)})")
    D = E // H
    conv = get("vit.embeddings.patch_embeddings.projection.weight")

    def stack(name, fn=lambda a: a):
        return np.stack([fn(get(f"vit.encoder.layer.{i}.{name}")) for i in range(L)])

    def linear_t(a):
        return a.T

    att = "attention.attention."
    params = {
        "patch_embed": {"kernel": conv.transpose(2, 3, 1, 0).reshape(-1, E),
                        "bias": get("vit.embeddings.patch_embeddings.projection.bias")},
        "cls_token": get("vit.embeddings.cls_token").reshape(-1),
        "pos_embed": get("vit.embeddings.position_embeddings").reshape(-1, E),
        "blocks": {
            "ln1": {"scale": stack("layernorm_before.weight"),
                    "bias": stack("layernorm_before.bias")},
            "attn": {
                "qkv": {"kernel": np.stack([stack(f"{att}{x}.weight",
                                                  lambda a: a.T.reshape(E, H, D))
                                            for x in ("query", "key", "value")], axis=2),
                        "bias": np.stack([stack(f"{att}{x}.bias", lambda a: a.reshape(H, D))
                                          for x in ("query", "key", "value")], axis=1)},
                "out": {"kernel": stack("attention.output.dense.weight",
                                        lambda a: a.T.reshape(H, D, E)),
                        "bias": stack("attention.output.dense.bias")},
            },
            "ln2": {"scale": stack("layernorm_after.weight"),
                    "bias": stack("layernorm_after.bias")},
            "mlp": {"fc1": {"kernel": stack("intermediate.dense.weight", linear_t),
                            "bias": stack("intermediate.dense.bias")},
                    "fc2": {"kernel": stack("output.dense.weight", linear_t),
                            "bias": stack("output.dense.bias")}},
        },
        "final_ln": {"scale": get("vit.layernorm.weight"), "bias": get("vit.layernorm.bias")},
    }
    if "vit.encoder.layer.0.layer_scale1.lambda1" in w:  # DINOv2's LayerScale
        for n in ("1", "2"):
            params["blocks"][f"ls{n}"] = {"gamma": stack(f"layer_scale{n}.lambda1")}
    if "vit.embeddings.register_tokens" in w:  # DINOv2 with registers
        params["reg_tokens"] = get("vit.embeddings.register_tokens").reshape(-1, E)
    pool = "cls"
    if "classifier.weight" in w:
        kernel = get("classifier.weight").T
        pool = "cls+mean" if kernel.shape[0] == 2 * E else "cls"  # DINOv2's linear head
        params["head"] = {"kernel": kernel, "bias": get("classifier.bias")}
    # Not weights of the function: the pooler (ViTModel's, unused by classification) and
    # DINOv2's mask token (masked-image pretraining only).
    w.skip(*(k for k in w.arrays if k.startswith("vit.pooler.")), "vit.embeddings.mask_token")
    w.refuse_unread(f"a transformers {config.get('model_type', 'vit')} model with {L} layers")
    return params, Found(format="hf", patch_size=conv.shape[2], channels=conv.shape[1],
                         heads=H, pool=pool, gelu=GELUS[act],
                         ln_eps=float(config.get("layer_norm_eps", 1e-12)), inputs=inputs,
                         notes=notes,
                         # DINOv2 with registers resizes antialiased, the others do not.
                         resample="hf-antialias" if "reg_tokens" in params else "hf")


# The writer's names of each model: (the prefix, ln1, ln2, fc1, fc2).
_VIT_NAMES = ("vit.", "layernorm_before", "layernorm_after", "intermediate.dense",
              "output.dense")
_DINOV2_NAMES = ("dinov2.", "norm1", "norm2", "mlp.fc1", "mlp.fc2")


def write(directory: str | os.PathLike, cfg: ViTConfig, params: dict,
          dtype: str = "F32") -> list[pathlib.Path]:
    """model.safetensors (of `dtype`, safetensors.WRITE_DTYPES), config.json and
    preprocessor_config.json, in `directory`, of a transformers model equal to the kit's
    model `cfg`: a `ViTForImageClassification` (pool cls) or a
    `Dinov2ForImageClassification` (pool cls+mean: DINOv2's head on the class token and
    the mean patch token; its layer scale kept, ones without one). Params without a head
    (a pretrained backbone) write no classifier."""
    if cfg.pool not in ("cls", "cls+mean") or cfg.stem or cfg.lsa or cfg.registers:
        raise WeightsError(f"{cfg.name}: transformers' ViTForImageClassification reads the "
                           f"class token, Dinov2ForImageClassification the class token and "
                           f"the mean patch token (cls+mean), and neither has a "
                           f"convolutional stem, locality self-attention or registers; this "
                           f"model has pool {cfg.pool!r}"
                           f"{', a stem' if cfg.stem else ''}{', lsa' if cfg.lsa else ''}"
                           f"{', registers' if cfg.registers else ''}")
    dinov2 = cfg.pool == "cls+mean"
    if dinov2 and cfg.mlp_dim % cfg.width:
        raise WeightsError(f"{cfg.name}: Dinov2ForImageClassification's MLP is a whole multiple "
                           f"of the width (mlp_ratio), but this model's is {cfg.mlp_dim} for "
                           f"width {cfg.width}")
    w = _state_dict(cfg, params, dinov2)
    mean, std = INPUT_SCALINGS[cfg.inputs]
    preprocessor = {"image_processor_type": "ViTImageProcessor", "do_resize": True,
                    "size": {"height": cfg.image_size, "width": cfg.image_size},
                    "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
                    "do_normalize": True, "image_mean": list(mean), "image_std": list(std)}
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.write(directory / "model.safetensors", w, {"format": "pt"}, dtype)
    (directory / "config.json").write_text(json.dumps(_config(cfg, dinov2), indent=2) + "\n")
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2)
                                                        + "\n")
    return [directory / n for n in ("model.safetensors", "config.json",
                                    "preprocessor_config.json")]


def _state_dict(cfg: ViTConfig, params: dict, dinov2: bool) -> dict:
    """The transformers state dict (transformers 4's names, the Hub's) of the kit's params."""
    E, H, D, L = cfg.width, cfg.heads, cfg.head_dim, cfg.depth
    top, ln1, ln2, fc1, fc2 = _DINOV2_NAMES if dinov2 else _VIT_NAMES
    b = params["blocks"]
    w = {f"{top}embeddings.patch_embeddings.projection.weight": rows_to_hwio(
            np.asarray(params["patch_embed"]["kernel"]), cfg.patch_size,
            cfg.channels).transpose(3, 2, 0, 1),
         f"{top}embeddings.patch_embeddings.projection.bias": params["patch_embed"]["bias"],
         f"{top}embeddings.cls_token": np.asarray(params["cls_token"]).reshape(1, 1, E),
         f"{top}embeddings.position_embeddings": np.asarray(params["pos_embed"])[None],
         f"{top}layernorm.weight": params["final_ln"]["scale"],
         f"{top}layernorm.bias": params["final_ln"]["bias"]}
    if "head" in params:
        w["classifier.weight"] = np.asarray(params["head"]["kernel"]).T
        w["classifier.bias"] = params["head"]["bias"]
    if dinov2:  # masked-image pretraining's token: unused by classification, but expected
        w[f"{top}embeddings.mask_token"] = np.zeros((1, E), np.float32)
    for i in range(L):
        p = f"{top}encoder.layer.{i}."
        w[p + f"{ln1}.weight"], w[p + f"{ln1}.bias"] = b["ln1"]["scale"][i], b["ln1"]["bias"][i]
        w[p + f"{ln2}.weight"], w[p + f"{ln2}.bias"] = b["ln2"]["scale"][i], b["ln2"]["bias"][i]
        for j, x in enumerate(("query", "key", "value")):
            w[p + f"attention.attention.{x}.weight"] = np.asarray(
                b["attn"]["qkv"]["kernel"][i][:, j]).reshape(E, H * D).T
            w[p + f"attention.attention.{x}.bias"] = np.asarray(
                b["attn"]["qkv"]["bias"][i][j]).reshape(-1)
        gammas = [np.asarray(b[ls]["gamma"][i]) if cfg.layer_scale is not None
                  else np.ones(E, np.float32) for ls in ("ls1", "ls2")]
        if dinov2:  # DINOv2 has LayerScale: kept as it is
            w[p + "layer_scale1.lambda1"], w[p + "layer_scale2.lambda1"] = gammas
            g1 = g2 = 1.0
        else:  # gamma * (x W + b) = x (W gamma) + b gamma: the layer scale folded in
            g1, g2 = gammas
        w[p + "attention.output.dense.weight"] = (np.asarray(
            b["attn"]["out"]["kernel"][i]).reshape(H * D, E) * g1).T
        w[p + "attention.output.dense.bias"] = np.asarray(b["attn"]["out"]["bias"][i]) * g1
        w[p + f"{fc1}.weight"] = np.asarray(b["mlp"]["fc1"]["kernel"][i]).T
        w[p + f"{fc1}.bias"] = b["mlp"]["fc1"]["bias"][i]
        w[p + f"{fc2}.weight"] = (np.asarray(b["mlp"]["fc2"]["kernel"][i]) * g2).T
        w[p + f"{fc2}.bias"] = np.asarray(b["mlp"]["fc2"]["bias"][i]) * g2
    return w


def _config(cfg: ViTConfig, dinov2: bool) -> dict:
    """config.json of the transformers model."""
    E = cfg.width
    # The class names: CIFAR-10's for a 10-class head (what the kit trains), else numbered.
    names = (CIFAR10_CLASSES if cfg.num_classes == len(CIFAR10_CLASSES)
             else tuple(f"LABEL_{k}" for k in range(cfg.num_classes)))
    config = {
        "architectures": ["Dinov2ForImageClassification" if dinov2
                          else "ViTForImageClassification"],
        "model_type": "dinov2" if dinov2 else "vit",
        "hidden_size": E, "num_hidden_layers": cfg.depth, "num_attention_heads": cfg.heads,
        "hidden_act": "gelu" if cfg.gelu == "exact" else "gelu_pytorch_tanh",
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02, "layer_norm_eps": cfg.ln_eps,
        "image_size": cfg.image_size, "patch_size": cfg.patch_size,
        "num_channels": cfg.channels, "qkv_bias": True,
        "id2label": {str(k): name for k, name in enumerate(names)},
        "label2id": {name: k for k, name in enumerate(names)},
    }
    if not dinov2:
        return {**config, "intermediate_size": cfg.mlp_dim}
    # DINOv2 sizes its MLP as hidden_size * mlp_ratio, an integer in transformers 5.
    return {**config, "mlp_ratio": cfg.mlp_dim // E, "layerscale_value": cfg.layer_scale or 1.0,
            "drop_path_rate": 0.0, "use_swiglu_ffn": False}
