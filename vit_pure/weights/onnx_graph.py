"""ONNX graphs of ViTs exported from torch (timm or transformers), read with `onnx`.

torch.onnx.export names each initializer after its parameter, except those it rewrites (a
Linear's weight, a sliced position embedding), which `state_dict` names back from the
nodes that read them; the state dict so rebuilt goes through hf.py's or timm.py's mapping,
whichever names it has (`read`). How names, prefixes and what the graph lacks are
handled: the comment above `_ANCHORS`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np

from vit_pure.errors import WeightsError
from vit_pure.weights import hf, timm
from vit_pure.weights.tree import Arrays, Found

# torch.onnx.export names each initializer after its parameter ("encoder.layer.0.norm1.
# weight"), except those it rewrites: a Linear's weight becomes a MatMul's right operand,
# transposed and unnamed ("onnx::MatMul_1966"), named back here from the node that reads it
# ("/encoder/layer.0/mlp/fc1/MatMul": encoder.layer.0.mlp.fc1.weight); a position
# embedding the graph slices (DINOv2's, resized in the graph) becomes its class row (1, 1,
# E) and patch rows (1, N, E), both read by nodes of the embeddings module. The state dict
# so rebuilt goes through hf.py's or timm.py's mapping, whichever names it has.
#
# The ViT may sit under a prefix, as the backbone of a larger model: the prefix is where
# the patch embedding's weight is; initializers outside it (a decoder, say) are left out,
# with a note naming them. The graph does not hold the head count (the caller's, else
# width / 64, noted) nor the input scaling (ImageNet's mean / std assumed, noted: DINOv2's
# and most torch ViTs'); the GELU is a Gelu node's or spelled out (Erf: exact; Tanh), the
# LayerNorm epsilon a LayerNormalization's or the constant added to the variance. The
# exporter merges identical tensors into one initializer (a model straight from its
# initialisation): such a graph is refused, naming the first weight it lacks.
# The patch embedding's weight names the library and the prefix of the model.
_ANCHORS = {"hf": "embeddings.patch_embeddings.projection.weight",
            "timm": "patch_embed.proj.weight"}
_TORCH_NAME = re.compile(r"[A-Za-z_]\w*(\.\w+)+")


def is_onnx(path) -> bool:
    return str(path).lower().endswith(".onnx")


def _import_onnx(path):
    try:
        import onnx  # optional: only an .onnx file needs it
        from onnx import numpy_helper
    except ImportError:
        raise WeightsError(f"{path}: reading an ONNX graph needs the onnx package "
                           f"(pip install onnx)") from None
    return onnx, numpy_helper


def _module(node) -> str:
    """The torch module a node belongs to, from its name: "/a/layer.0/fc1/MatMul" ->
    "a.layer.0.fc1"."""
    return ".".join(node.name.strip("/").split("/")[:-1])


def state_dict(path) -> tuple[dict[str, np.ndarray], dict]:
    """(the torch state dict the graph's initializers hold, facts of the graph: "gelu",
    "ln_eps")."""
    onnx, numpy_helper = _import_onnx(path)
    try:
        graph = onnx.load(os.fspath(path)).graph
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and OSError alike
        raise WeightsError(f"{path}: not a readable ONNX graph ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})") from None
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    readers: dict[str, list] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, k))
    state, pieces = {}, {}
    for name, a in inits.items():
        if _TORCH_NAME.fullmatch(name):
            state[name] = a
            continue
        for node, k in readers.get(name, ()):
            module = _module(node)
            if node.op_type == "MatMul" and k == 1 and a.ndim == 2:
                state[f"{module}.weight"] = a.T  # torch's (out, in)
            elif module.endswith("embeddings") and a.ndim == 3 and a.dtype.kind == "f":
                pieces.setdefault(module, []).append(a)  # the sliced position embedding
    for module, parts in pieces.items():
        rows = sorted(parts, key=lambda a: a.shape[1])
        if len(rows) == 2 and rows[0].shape[1] == 1 and math.isqrt(rows[1].shape[1]) ** 2 \
                == rows[1].shape[1]:
            state.setdefault(f"{module}.position_embeddings", np.concatenate(rows, axis=1))
    facts = {"gelu": _gelu(graph), "ln_eps": _layer_norm_eps(graph, inits, numpy_helper)}
    return {k: np.asarray(v, np.float32) for k, v in state.items()}, facts


def _gelu(graph) -> str:
    """"exact" or "tanh": a Gelu node's `approximate` (opset 20), else Erf (exact) or Tanh
    nodes spelling it out."""
    for node in graph.node:
        if node.op_type == "Gelu":
            approx = next((a.s for a in node.attribute if a.name == "approximate"), b"none")
            return "tanh" if approx == b"tanh" else "exact"
    ops = {n.op_type for n in graph.node}
    return "tanh" if "Tanh" in ops and "Erf" not in ops else "exact"


def _layer_norm_eps(graph, inits, numpy_helper) -> float | None:
    """The epsilon of the first LayerNorm: a LayerNormalization node's, or the scalar added
    to the variance before the Sqrt of one spelled out in ReduceMean, Pow, Add, Sqrt."""
    consts = {o: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
              for o in n.output}
    consts.update(inits)
    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type == "LayerNormalization":
            return float(f"{next((a.f for a in node.attribute if a.name == 'epsilon'), 1e-5):.7g}")
        if node.op_type == "Sqrt" and getattr(producer.get(node.input[0]), "op_type", "") \
                == "Add":
            scalars = [consts[x] for x in producer[node.input[0]].input
                       if x in consts and consts[x].size == 1]
            if scalars:  # float32's 1e-6 read back as 1e-6, not 9.99999997e-07
                return float(f"{float(scalars[0].reshape(())):.7g}")
    return None


def read(path: str | os.PathLike, heads: int | None = None) -> tuple[dict, Found]:
    """(the kit's tree, what the graph says) of an ONNX graph of a timm or transformers
    ViT (or one under a prefix: a backbone)."""
    state, facts = state_dict(path)
    anchor = next(((lib, k[:-len(a)]) for k in sorted(state) for lib, a in _ANCHORS.items()
                   if k.endswith(a) and (k == a or k[:-len(a)].endswith("."))), None)
    if anchor is None:
        raise WeightsError(f"{path}: no initializer named like a ViT's patch embedding "
                           f"({' or '.join(_ANCHORS.values())}, under any prefix): not a "
                           f"graph exported from a timm or transformers ViT")
    library, prefix = anchor
    # transformers' ...ForImageClassification: the classifier beside "vit." / "dinov2.".
    head = ("classifier.",) if library == "hf" and prefix in ("vit.", "dinov2.") else ()
    notes = []
    outside = sorted({k.split(".")[0] for k in state if not k.startswith((prefix, *head))})
    if outside:
        count = sum(not k.startswith((prefix, *head)) for k in state)
        notes.append(f"the ViT under {prefix!r}: {count} initializers outside it left out "
                     f"({', '.join(o + '.*' for o in outside)})")
    w = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()
         if k.startswith((prefix, *head))}
    width = w[_ANCHORS[library]].shape[0]
    if heads is None or width % heads:
        heads = max(1, width // 64)
        notes.append(f"head count not in the graph: assumed width / 64 = {heads}")
    notes.append("input scaling not in the graph: ImageNet mean / std assumed")
    if library == "timm":
        params, found = timm.state_dict_tree(Arrays(w, path), heads, {}, path)
        found = dataclasses.replace(found, gelu=facts["gelu"], inputs="imagenet",
                                    ln_eps=facts["ln_eps"] or found.ln_eps)
    else:
        w = hf.canonical_names(w)
        depth = 0
        while f"vit.encoder.layer.{depth}.layernorm_before.weight" in w:
            depth += 1
        config = {"hidden_size": width, "num_hidden_layers": depth,
                  "num_attention_heads": heads,
                  "hidden_act": "gelu" if facts["gelu"] == "exact" else "gelu_pytorch_tanh",
                  "layer_norm_eps": facts["ln_eps"] or 1e-12}
        params, found = hf.state_dict_tree(Arrays(w, path), config, path, "imagenet")
    return params, dataclasses.replace(found, format="onnx",
                                       notes=(*found.notes, *notes))
