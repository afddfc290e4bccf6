"""Pallas kernels (lowered to Triton for NVIDIA GPUs) for what XLA:GPU cannot fuse.

mlp.py: fc2 and the GELU before it, forward and backward, as three kernels that never
        write the GELU's output (`--mlp-kernels`).
qkv.py: the attention's q, k, v projection written straight into cuDNN's padded inputs,
        and its input and bias gradients (`--qkv-projection`).
Each module runs the same arithmetic on whole arrays in XLA when its program is lowered
for a CPU, and its kernels in Pallas's interpreter for the tests.
"""
