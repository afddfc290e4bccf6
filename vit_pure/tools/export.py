"""Export a checkpoint of the kit as Hugging Face or timm weights.

    python -m vit_pure.tools.export CKPT --to hf DIR     # model.safetensors, config.json,
                                                         # preprocessor_config.json
    python -m vit_pure.tools.export CKPT --to timm DIR   # model.safetensors, config.json

CKPT is one checkpoint (ckpt_dir/step_00001200) or a --ckpt-dir, whose newest intact
checkpoint is taken; the model is the one it records, the weights its params in float32
(or with --ema their EMA). Then `ViTForImageClassification.from_pretrained(DIR)`, or with
timm: `timm.create_model(config["architecture"], pretrained=True, pretrained_cfg_overlay=
dict(config["pretrained_cfg"], file=DIR + "/model.safetensors"), **config["model_args"])`
with config = DIR/config.json. A --pool cls+mean model (a DINOv2 fine-tune) exports to hf
as a Dinov2ForImageClassification; --pool mean or gap only to timm; a stem or lsa, not at all.
"""
from __future__ import annotations

import pathlib
import sys

import numpy as np

from vit_pure.config import ViTConfig
from vit_pure.errors import CheckpointError
from vit_pure.run import checkpoint, cli
from vit_pure.weights import EXPORTS, save


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


def main(argv=None) -> int:
    parser = cli.doc_parser(__doc__)
    parser.add_argument("checkpoint", metavar="CKPT")
    parser.add_argument("--to", required=True, choices=list(EXPORTS), help="the format")
    parser.add_argument("out", metavar="DIR", help="the folder to write (created)")
    parser.add_argument("--ema", action="store_true",
                        help="export the EMA of the weights instead of the weights")
    args = parser.parse_args(argv)

    def run():
        cfg, params = read_checkpoint(args.checkpoint, args.ema)
        for f in save(args.out, cfg, params, args.to):
            print(f"wrote {f}")

    return cli.main_guard(run)


if __name__ == "__main__":
    sys.exit(main())
