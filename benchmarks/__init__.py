"""Benchmarks and studies of the kit, run as modules from the repository root (each one's
--help is its docstring, with the commands it was run with):

    python -m benchmarks.bench ...              images/s, FLOPs, MFU, memory per configuration
    python -m benchmarks.study ...              the dtype / precision grid
    python -m benchmarks.peers ...              the kit against Flax NNX and PyTorch, one device
    python -m benchmarks.deviceless ...         configurations compiled for a GPU without one
    python -m benchmarks.profile_breakdown DIR  a profiler trace's device time by kernel kind
    python -m benchmarks.gpu_check ...          the one prepared GPU check

The probes, each one question: benchmarks/probes/__init__.py. What they share: harness.py,
rows.py (bench.py's row grammars) and bench.py's helpers for the kit's own training step;
programs are read through vit_pure/xla/hlo.py and FLOPs counted by vit_pure/xla/flops.py.
"""
