"""Hugging Face transformers' ViT: ``model.safetensors`` + ``config.json`` (+ the optional
``preprocessor_config.json``) in one folder, as `save_pretrained` writes them.

Key names as the Hub's checkpoints have them (transformers 4; transformers 5 reads them
and writes the names in brackets, which are read too)::

    vit.embeddings.cls_token (1, 1, E)     vit.embeddings.position_embeddings (1, T, E)
    vit.embeddings.patch_embeddings.projection.{weight (E, C, p, p), bias}
    vit.encoder.layer.{i}.  (vit.layers.{i}.)
        layernorm_before / layernorm_after .{weight,bias}
        attention.attention.{query,key,value}.{weight (E, E), bias}   (attention.{q,k,v}_proj)
        attention.output.dense.{weight,bias}                          (attention.o_proj)
        intermediate.dense.{weight (M, E), bias}                      (mlp.fc1)
        output.dense.{weight (E, M), bias}                            (mlp.fc2)
    vit.layernorm.{weight,bias}            classifier.{weight (K, E), bias}

A `ViTModel` checkpoint has no "vit." prefix and no classifier (its pooler, unused by
classification, is left out). config.json gives the head count, `hidden_act` ("gelu" the
exact GELU, "gelu_pytorch_tanh" / "gelu_new" the tanh form) and `layer_norm_eps` (1e-12 by
default); preprocessor_config.json's image_mean / image_std the input scaling (without
it, ViTImageProcessor's default: [-1, 1]).
"""
from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np

from vit_pure.config import INPUT_SCALINGS, ViTConfig
from vit_pure.errors import WeightsError
from vit_pure.weights import safetensors
from vit_pure.weights.timm import scaling_name
from vit_pure.weights.tree import Found, rows_to_hwio

GELUS = {"gelu": "exact", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh",
         "gelu_fast": "tanh"}
# transformers 5's names -> transformers 4's (the Hub's), which the reader takes.
_V5 = [(r"^vit\.layers\.", "vit.encoder.layer."),
       (r"\.attention\.q_proj\.", ".attention.attention.query."),
       (r"\.attention\.k_proj\.", ".attention.attention.key."),
       (r"\.attention\.v_proj\.", ".attention.attention.value."),
       (r"\.attention\.o_proj\.", ".attention.output.dense."),
       (r"\.mlp\.fc1\.", ".intermediate.dense."), (r"\.mlp\.fc2\.", ".output.dense.")]


def is_hf_config(path: pathlib.Path) -> bool:
    """Whether `path` is a transformers ViT config.json."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") == "vit"


def _json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: not readable JSON ({e})") from None


def read(path: str | os.PathLike) -> tuple[dict, Found]:
    """(the kit's tree, what the files say) of a folder (or its model.safetensors)."""
    path = pathlib.Path(path)
    folder = path if path.is_dir() else path.parent
    weights = path if path.is_file() else folder / "model.safetensors"
    config = _json(folder / "config.json")
    raw, _ = safetensors.read(weights)
    w = {}
    for k, v in raw.items():
        k = k if k.startswith(("vit.", "classifier.")) else "vit." + k
        for pattern, repl in _V5:
            k = re.sub(pattern, repl, k)
        w[k] = v
    used: set[str] = set()

    def get(key):
        if key not in w:
            raise WeightsError(f"{weights}: no {key} in the file")
        used.add(key)
        return w[key]

    try:
        E, L, H = (int(config[k]) for k in ("hidden_size", "num_hidden_layers",
                                           "num_attention_heads"))
    except (KeyError, TypeError, ValueError):
        raise WeightsError(f"{folder / 'config.json'}: no hidden_size, num_hidden_layers and "
                           f"num_attention_heads") from None
    act = config.get("hidden_act", "gelu")
    if act not in GELUS:
        raise WeightsError(f"{folder / 'config.json'}: hidden_act {act!r} is not a GELU the "
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
    if "classifier.weight" in w:
        params["head"] = {"kernel": get("classifier.weight").T, "bias": get("classifier.bias")}
    extra = sorted(k for k in set(w) - used if not k.startswith("vit.pooler."))
    if extra:
        raise WeightsError(f"{weights}: {extra[0]} {w[extra[0]].shape} is not a weight of a "
                           f"transformers ViT with {L} layers")
    inputs = "minus1to1"
    pre = folder / "preprocessor_config.json"
    if pre.is_file():
        p = _json(pre)
        if "image_mean" in p and "image_std" in p:
            inputs = scaling_name(p["image_mean"], p["image_std"]) or ""
            if not inputs:
                raise WeightsError(f"{pre}: image_mean / image_std {p['image_mean']} / "
                                   f"{p['image_std']} is none of the kit's scalings "
                                   f"({', '.join(INPUT_SCALINGS)})")
    return params, Found(format="hf", patch_size=conv.shape[2], channels=conv.shape[1],
                         heads=H, pool="cls", gelu=GELUS[act],
                         ln_eps=float(config.get("layer_norm_eps", 1e-12)), inputs=inputs)


def write(directory: str | os.PathLike, cfg: ViTConfig, params: dict) -> list[pathlib.Path]:
    """model.safetensors, config.json and preprocessor_config.json of a
    `ViTForImageClassification` equal to the kit's model `cfg`, in `directory`."""
    if cfg.pool != "cls" or cfg.stem or cfg.lsa:
        raise WeightsError(f"{cfg.name}: transformers' ViTForImageClassification reads the "
                           f"class token and has no convolutional stem or locality "
                           f"self-attention; this model has pool {cfg.pool!r}"
                           f"{', a stem' if cfg.stem else ''}{', lsa' if cfg.lsa else ''}")
    E, H, D, L = cfg.width, cfg.heads, cfg.head_dim, cfg.depth
    b = params["blocks"]
    w = {"vit.embeddings.patch_embeddings.projection.weight": rows_to_hwio(
            np.asarray(params["patch_embed"]["kernel"]), cfg.patch_size,
            cfg.channels).transpose(3, 2, 0, 1),
         "vit.embeddings.patch_embeddings.projection.bias": params["patch_embed"]["bias"],
         "vit.embeddings.cls_token": np.asarray(params["cls_token"]).reshape(1, 1, E),
         "vit.embeddings.position_embeddings": np.asarray(params["pos_embed"])[None],
         "vit.layernorm.weight": params["final_ln"]["scale"],
         "vit.layernorm.bias": params["final_ln"]["bias"],
         "classifier.weight": np.asarray(params["head"]["kernel"]).T,
         "classifier.bias": params["head"]["bias"]}
    for i in range(L):
        p = f"vit.encoder.layer.{i}."
        w[p + "layernorm_before.weight"] = b["ln1"]["scale"][i]
        w[p + "layernorm_before.bias"] = b["ln1"]["bias"][i]
        w[p + "layernorm_after.weight"] = b["ln2"]["scale"][i]
        w[p + "layernorm_after.bias"] = b["ln2"]["bias"][i]
        for j, x in enumerate(("query", "key", "value")):
            w[p + f"attention.attention.{x}.weight"] = np.asarray(
                b["attn"]["qkv"]["kernel"][i][:, j]).reshape(E, H * D).T
            w[p + f"attention.attention.{x}.bias"] = np.asarray(
                b["attn"]["qkv"]["bias"][i][j]).reshape(-1)
        w[p + "attention.output.dense.weight"] = np.asarray(
            b["attn"]["out"]["kernel"][i]).reshape(H * D, E).T
        w[p + "attention.output.dense.bias"] = b["attn"]["out"]["bias"][i]
        w[p + "intermediate.dense.weight"] = np.asarray(b["mlp"]["fc1"]["kernel"][i]).T
        w[p + "intermediate.dense.bias"] = b["mlp"]["fc1"]["bias"][i]
        w[p + "output.dense.weight"] = np.asarray(b["mlp"]["fc2"]["kernel"][i]).T
        w[p + "output.dense.bias"] = b["mlp"]["fc2"]["bias"][i]
    config = {
        "architectures": ["ViTForImageClassification"], "model_type": "vit",
        "hidden_size": E, "num_hidden_layers": L, "num_attention_heads": H,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "gelu" if cfg.gelu == "exact" else "gelu_pytorch_tanh",
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02, "layer_norm_eps": cfg.ln_eps,
        "image_size": cfg.image_size, "patch_size": cfg.patch_size,
        "num_channels": cfg.channels, "qkv_bias": True,
        "id2label": {str(k): f"LABEL_{k}" for k in range(cfg.num_classes)},
        "label2id": {f"LABEL_{k}": k for k in range(cfg.num_classes)},
    }
    mean, std = INPUT_SCALINGS[cfg.inputs]
    preprocessor = {"image_processor_type": "ViTImageProcessor", "do_resize": True,
                    "size": {"height": cfg.image_size, "width": cfg.image_size},
                    "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
                    "do_normalize": True, "image_mean": list(mean), "image_std": list(std)}
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.write(directory / "model.safetensors", w, {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2)
                                                        + "\n")
    return [directory / n for n in ("model.safetensors", "config.json",
                                    "preprocessor_config.json")]
