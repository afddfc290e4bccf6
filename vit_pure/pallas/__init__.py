"""Pallas kernels (lowered to Triton for NVIDIA GPUs) for what XLA:GPU cannot fuse.

mlp.py: the MLP's backward through fc2 and the GELU as one kernel (`--mlp-backward`).
Each module runs the same arithmetic on whole arrays in XLA when its program is lowered
for a CPU, and its kernel in Pallas's interpreter for the tests.
"""
