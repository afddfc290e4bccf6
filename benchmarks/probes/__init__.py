"""Single-question probes, run as `python -m benchmarks.probes.NAME` (each one's --help is
its docstring, with its commands). A probe whose question is answered, and whose answer
is written down in the docs with its command and result, may go (git keeps it).

    matmul_vjp         does the float32-output matmuls' custom VJP pay? docs/precision.md
    attention_check    are the --attention implementations as accurate as einsum, and
                       faster? docs/performance.md, "Attention implementations"
    dropout_masks      which PRNG keeps dropout masks per example, runs in shard_map, and
                       is fastest? docs/performance.md, "Dropout masks on a CPU"
    gemm_epilogues     which library and epilogue does each GEMM get? (no GPU run yet)
    loop_overhead      the training loop's img/s against the step alone:
                       docs/performance.md, "The training loop against the step alone"
    bench_data         how fast are the input pipeline's parts? (not written down)
    bench_randaugment  does RandAugment cost the sum of its ops? (not written down)
"""
