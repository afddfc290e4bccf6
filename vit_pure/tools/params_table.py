"""Print a parameter table: path, shape, dtype, bytes, and the total.

    python -m vit_pure.tools.params_table --model vit-cifar --param-dtype bf16
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from vit_pure.config import PRESETS, get_preset
from vit_pure.model import init_params
from vit_pure.policy import parse_dtype
from vit_pure.run import cli


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_rows(params) -> list[tuple[str, tuple, str, int]]:
    rows = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        nbytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        rows.append((_path_str(path), tuple(x.shape), jnp.dtype(x.dtype).name, nbytes))
    return rows


def format_param_table(params, title: str = "") -> str:
    rows = param_rows(params)
    width = max(len(r[0]) for r in rows)
    lines = [title] if title else []
    lines.append(f"{'parameter':<{width}}  {'shape':<22} {'dtype':<9} {'bytes':>12}")
    for path, shape, dtype, nbytes in rows:
        lines.append(f"{path:<{width}}  {str(shape):<22} {dtype:<9} {nbytes:>12,}")
    total = sum(math.prod(r[1]) for r in rows)
    total_bytes = sum(r[3] for r in rows)
    lines.append(f"{'total':<{width}}  {f'{total:,} params':<22} {'':<9} {total_bytes:>12,}"
                 f"  ({total_bytes / 2**20:.2f} MiB)")
    return "\n".join(lines)


def main(argv=None):
    parser = cli.doc_parser(__doc__)
    parser.add_argument("--model", default="vit-cifar", choices=sorted(PRESETS))
    parser.add_argument("--param-dtype", default="f32", nargs="+",
                        help="one or more of f32, bf16, f16")
    args = parser.parse_args(argv)
    cfg = get_preset(args.model)
    # Shapes only: no arrays are materialised for the table.
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    dtypes = args.param_dtype if isinstance(args.param_dtype, list) else [args.param_dtype]
    try:
        dtypes = [parse_dtype(name) for name in dtypes]
    except ValueError as e:
        parser.error(f"--param-dtype: {e}")
    for dtype in dtypes:
        cast = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes)
        print(format_param_table(cast, f"# {cfg.name}, params in {jnp.dtype(dtype).name}"))
        print()


if __name__ == "__main__":
    main()
