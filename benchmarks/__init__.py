"""Benchmarks and studies of the kit, run as modules from the repository root.

The tools (each one's --help is its docstring, with the commands it was run with):

    python -m benchmarks.bench ...              images/s, FLOPs, MFU, memory per configuration
    python -m benchmarks.study ...              the dtype / precision grid
    python -m benchmarks.peers ...              the kit against Flax NNX and PyTorch, one device
    python -m benchmarks.deviceless ...         configurations compiled for an H100 without one:
                                                memory, kernels, HBM traffic by class, floor
    python -m benchmarks.profile_breakdown DIR  a profiler trace's device time by kernel kind

The probes, each one question (benchmarks/probes/__init__.py says where its answer is):

    python -m benchmarks.probes.matmul_vjp       the custom VJP of float32-output matmuls
    python -m benchmarks.probes.attention_check  the --attention implementations (GPU)
    python -m benchmarks.probes.dropout_masks    PRNGs for the dropout masks
    python -m benchmarks.probes.gemm_epilogues   which library and epilogue each GEMM gets
    python -m benchmarks.probes.loop_overhead    the training loop against the step alone
    python -m benchmarks.probes.bench_data       the input pipeline's throughput
    python -m benchmarks.probes.bench_randaugment  RandAugment and each of its ops, timed

What they share: harness.py, rows.py (bench.py's two row grammars, checked before any row
runs) and bench.py's helpers for the kit's own training step; harness.py's docstring lists
them. Programs are read through vit_pure/xla/hlo.py and FLOPs counted by vit_pure/xla/flops.py.
"""
