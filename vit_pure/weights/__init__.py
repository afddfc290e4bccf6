"""Pretrained weights in and out: big_vision / AugReg .npz, timm and Hugging Face
safetensors, ONNX graphs exported from either, read into the kit's tree and written out.

    cfg, params = load("B_16-i21k-....npz")              # (ViTConfig, float32 numpy tree)
    params, notes = fit(params, cfg, target_cfg, path)   # resample pos_embed, new head
    save("out/", cfg, params, "hf")                      # or "timm"

`load` finds the format from the file (`detect`). The tree is `model.init_params`'s, on
the host: the scripts lay it out on their devices as they lay out a checkpoint, so it
trains under every layout. The files are read with numpy alone (safetensors.py; `onnx`
for a graph); torch, timm and transformers are never imported.
"""
from __future__ import annotations

import os
import pathlib

from vit_pure.config import ViTConfig
from vit_pure.errors import WeightsError
from vit_pure.weights import bigvision, hf, onnx_graph, safetensors, timm
from vit_pure.weights.fetch import is_url, local_path
from vit_pure.weights.tree import RESAMPLERS, Found, config_of, fit

FORMATS = ("bigvision", "timm", "hf", "onnx")  # what `load` reads
EXPORTS = ("hf", "timm")  # what `save` writes

__all__ = ["FORMATS", "EXPORTS", "RESAMPLERS", "Found", "config_of", "detect", "fit", "load",
           "load_found", "save", "resolve"]


def resolve(path: str, log=print) -> pathlib.Path:
    """A local path for `path`: itself, or the cached copy of a URL (fetch.py)."""
    return local_path(path, log) if is_url(path) else pathlib.Path(path).expanduser()


def detect(path: str | os.PathLike) -> str:
    """The format of `path`, one of FORMATS; WeightsError if it is none of them."""
    path = pathlib.Path(path)
    if path.is_dir():
        if (path / "model.safetensors").is_file() and hf.is_hf_config(path / "config.json"):
            return "hf"
        raise WeightsError(f"{path}: a folder without model.safetensors and a transformers "
                           f"ViT config.json")
    if not path.is_file():
        raise WeightsError(f"{path}: no such file")
    if bigvision.is_npz(path):
        return "bigvision"
    if onnx_graph.is_onnx(path):
        return "onnx"
    safetensors.read_header(path)  # raises if it is not safetensors either
    return "hf" if hf.is_hf_config(path.parent / "config.json") else "timm"


def load_found(path: str | os.PathLike, heads: int | None = None) -> tuple[dict, Found]:
    """(the kit's parameter tree, `Found`: what the file says of its model). `heads`:
    the head count, which timm's files do not hold (the other formats ignore it)."""
    fmt = detect(path)
    if fmt == "bigvision":
        return bigvision.read(path)
    if fmt == "timm":
        return timm.read(path, heads)
    if fmt == "onnx":
        return onnx_graph.read(path, heads)
    return hf.read(path)


def load(path: str | os.PathLike, heads: int | None = None) -> tuple[ViTConfig, dict]:
    """(ViTConfig, params) of a weights file: the model as the file has it."""
    params, found = load_found(path, heads)
    return config_of(params, found, f"{found.format}:{pathlib.Path(path).name}"), params


def save(path: str | os.PathLike, cfg: ViTConfig, params: dict, format: str,
         dtype: str = "F32") -> list:
    """Write `params` of model `cfg` into the folder `path` as `format` (EXPORTS), hf's
    tensors as `dtype` (safetensors.WRITE_DTYPES); returns the files written."""
    if format == "hf":
        return hf.write(path, cfg, params, dtype)
    if dtype != "F32":
        raise WeightsError(f"--dtype {dtype}: {format} is written in float32 only")
    if format == "timm":
        return timm.write(path, cfg, params)
    raise WeightsError(f"unknown export format {format!r}; choose one of {', '.join(EXPORTS)}")
