r"""Which library runs each matrix product of the compiled training step, with which epilogue.

    python -m benchmarks.probes.gemm_epilogues --batch 4096 --dtype bf16
    XLA_FLAGS=--xla_gpu_enable_cublaslt=true \
        python -m benchmarks.probes.gemm_epilogues --batch 4096 --dtype bf16
    python -m benchmarks.probes.gemm_epilogues --model tiny --batch 8     # on a CPU: dot ops only

Compiles (does not run) the kit's training step as `benchmarks.peers` builds a kit row and
reads XLA's optimized HLO. On a GPU each dot becomes a cuBLAS call, a cuBLASLt call (which
can fuse a bias add and a GELU into the GEMM as its "epilogue": BIAS, GELU, BIAS_GELU and
their _AUX forms) or a fusion XLA generates (Triton, cuDNN); the table counts them by
target and epilogue. The kit's MLP gives the pattern (fc1's bias added by the product
itself, a ones column, then `jax.nn.gelu`'s tanh form); whether XLA takes it depends on
its flags (docs/performance.md). On a CPU the table counts XLA:CPU's dot instructions.
"""
from __future__ import annotations

import argparse
import collections
import re
import shlex

import jax

from benchmarks import bench, harness
from benchmarks.peers import kit
from vit_pure import step
from vit_pure.config import PRESETS
from vit_pure.run import cli
from vit_pure.xla import hlo

# The libraries a GEMM runs in on a GPU: cuBLAS custom-call targets, and XLA's own GEMM
# fusions (their fusion kind).
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_GEMM_FUSIONS = ("__triton_gemm", "__cudnn$fusion", "__triton_nested_gemm_fusion")


def _attr(instr: hlo.Instr, key: str) -> str | None:
    """A string field of an instruction's attributes, `key="v"` or `"key":"v"` (its
    backend_config JSON)."""
    found = re.search(rf'\b{re.escape(key)}"?[=:]"([^"]+)"', instr.attrs)
    return found.group(1) if found else None


def count_gemms(hlo_text: str) -> collections.Counter:
    """(library, epilogue) -> how many, over the instructions of an optimized HLO module
    (read with vit_pure/xla/hlo.py; instruction lines without their computation are read
    as one). Library: a cuBLAS custom-call target or a GEMM fusion kind; where there are
    none (a CPU), "dot" for XLA's dot instructions. (On a GPU the dots left in the text
    are the insides of the GEMM fusions, already counted as their fusion.)"""
    if not any(line.startswith("ENTRY") for line in hlo_text.splitlines()):
        hlo_text = "ENTRY %fragment {\n" + hlo_text + "\n}"
    module = hlo.parse_module(hlo_text)
    counts, dots = collections.Counter(), 0
    for instr in (i for comp in module.computations.values() for i in comp):
        target = _attr(instr, "custom_call_target") if instr.opcode == "custom-call" else None
        kind = _attr(instr, "kind") if instr.opcode == "fusion" else None
        if target in _GEMM_TARGETS:
            counts[(target, _attr(instr, "epilogue") or "DEFAULT")] += 1
        elif kind in _GEMM_FUSIONS:
            counts[(kind, "-")] += 1
        elif instr.opcode == "dot":
            dots += 1
    if not counts and dots:
        counts[("dot", "-")] = dots
    return counts


def format_table(counts: collections.Counter) -> str:
    rows = [[library, epilogue, n] for (library, epilogue), n in sorted(counts.items())]
    return harness.markdown_table(["library", "epilogue", "GEMMs"],
                                  rows + [["all", "", sum(counts.values())]], numeric=(2,))


def build_parser() -> argparse.ArgumentParser:
    p = cli.doc_parser(__doc__)
    p.add_argument("--model", default="vit-cifar", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=4096, help="batch (one device)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--flags", default="", help="more training-script flags, e.g. '--dropout 0'")
    p.add_argument("--hlo", default=None, metavar="PATH",
                   help="also write the optimized HLO text to PATH")
    return p


def compiled_step_text(job: dict) -> str:
    """The optimized HLO of the kit row `job` (as benchmarks.peers builds it)."""
    sc, optimizer, strategy = kit.build_kit(job)
    state = strategy.put_state(step.init_state(jax.random.key(0), sc.cfg, sc.policy, optimizer))
    inputs = bench.step_inputs(strategy, job["batch"])(0)
    return strategy.train_step.lower(state, *inputs).compile().as_text()


def main(argv=None) -> collections.Counter:
    p = build_parser()
    args = p.parse_args(argv)
    cli.require_positive(p, args, "batch")
    job = {"model": args.model, "batch": args.batch, "dtype": args.dtype,
           "precision": "default", "kit_flags": shlex.split(args.flags)}
    text = compiled_step_text(job)
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(text)
    counts = count_gemms(text)
    print(f"# {args.model}, batch {args.batch}, {args.dtype} {args.flags}; "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(format_table(counts))
    return counts


if __name__ == "__main__":
    main()
