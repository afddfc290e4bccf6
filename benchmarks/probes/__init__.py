"""Single-question probes, run as `python -m benchmarks.probes.NAME` (each one's --help is
its docstring, with its commands). A probe whose question is answered, and whose answer
is written down in the docs with its command and result, may go (git keeps it).

    matmul_vjp         does the custom VJP of float32-output matmuls (bf16 backward
                       products) pay? docs/precision.md, "The dtype policy": not on an
                       AVX2-only CPU; measured with this probe there only
    attention_check    are the --attention implementations as accurate as einsum, and
                       faster? docs/performance.md, "Attention implementations" (H100)
    dropout_masks      which PRNG keeps each example's dropout mask independent of the
                       batch split, runs inside shard_map, and is fastest?
                       docs/performance.md, "Dropout masks on a CPU"
    gemm_epilogues     which library and epilogue does each GEMM of the compiled step get?
                       docs/performance.md, "GEMM epilogues": not yet measured on a GPU
    loop_overhead      how far does the training loop's logged img/s fall short of the
                       step alone? docs/performance.md, "The training loop against the
                       step alone"
    bench_data         how fast are the input pipeline's parts? (not written down)
    bench_randaugment  does RandAugment cost the sum of its ops? (not written down)
"""
