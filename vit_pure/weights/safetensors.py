"""The safetensors format, read and written with numpy (and ml_dtypes for bfloat16).

The format (https://huggingface.co/docs/safetensors, "Format"): 8 bytes, the header's
length N as a little-endian unsigned 64-bit integer; N bytes of UTF-8 JSON mapping each
tensor's name to {"dtype", "shape", "data_offsets": [begin, end]} (byte offsets into the
data that follows the header), plus an optional "__metadata__" of string to string; then
the data, each tensor row-major and little-endian. Writers pad the header with spaces
to a multiple of 8 bytes. Nothing in the file is executed, as with the kit's checkpoints.

`read` returns every tensor as float32 (bfloat16 and float16 widened exactly); `write`
stores float32 arrays as they are, or rounded to bfloat16 (to nearest, ties to even): half
the bytes, for a copy that must be small.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes  # a dependency of jax: bfloat16's rounding
import numpy as np

from vit_pure.errors import WeightsError

# safetensors dtype names -> numpy dtypes read as they are (BF16 is handled apart).
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
           "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
_MAX_HEADER = 100 << 20  # the format's own limit (100 MB)


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(header without "__metadata__" plus it under "__metadata__", data start offset).
    WeightsError if the file is not safetensors."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < n <= _MAX_HEADER:
                raise WeightsError(f"{path}: not a safetensors file (bad header length)")
            header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError(f"{path}: not a safetensors file (header is not JSON)") from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: not a safetensors file (header is not a JSON object)")
    return header, 8 + n


def read(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """({name: float32 array}, metadata) of a safetensors file."""
    header, start = read_header(path)
    meta = header.pop("__metadata__", None) or {}
    size = os.path.getsize(path) - start
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            try:
                dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"{path}: bad safetensors entry for {name!r}") from None
            if dtype != "BF16" and dtype not in _DTYPES:
                raise WeightsError(f"{path}: {name}: unsupported dtype {dtype}")
            itemsize = 2 if dtype == "BF16" else np.dtype(_DTYPES[dtype]).itemsize
            if not 0 <= begin <= end <= size or end - begin != itemsize * int(np.prod(shape)):
                raise WeightsError(f"{path}: {name}: data offsets {begin}..{end} do not fit "
                                   f"shape {shape} {dtype} (file truncated?)")
            f.seek(start + begin)
            raw = f.read(end - begin)
            if dtype == "BF16":  # the upper half of a float32's bits
                bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
                a = bits.view(np.float32)
            else:
                a = np.frombuffer(raw, _DTYPES[dtype]).astype(np.float32)
            out[name] = a.reshape(shape)
    return out, dict(meta)


WRITE_DTYPES = ("F32", "BF16")


def write(path: str | os.PathLike, tensors: dict[str, np.ndarray],
          metadata: dict[str, str] | None = None, dtype: str = "F32") -> None:
    """Write float32 `tensors` (in name order) as a safetensors file of `dtype`
    (WRITE_DTYPES)."""
    if dtype not in WRITE_DTYPES:
        raise WeightsError(f"safetensors: writes {', '.join(WRITE_DTYPES)}, not {dtype!r}")
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    arrays, offset = [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        if dtype == "BF16":
            a = bfloat16_bits(a)
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for a in arrays:
            f.write(a.tobytes())


def bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 `a` rounded to bfloat16 as ml_dtypes (JAX's) rounds (to nearest, ties to
    even; NaN stays NaN, past the largest bfloat16 is infinity), as the 16-bit patterns."""
    return np.ascontiguousarray(a, dtype="<f4").astype(ml_dtypes.bfloat16).view("<u2")
