"""Benchmarks and studies of the kit, run as modules from the repository root:

    python -m benchmarks.bench ...      images/s, FLOPs, MFU, memory per configuration
    python -m benchmarks.study ...      the dtype / precision grid
    python -m benchmarks.peers ...      the kit against Flax NNX and PyTorch on one device
"""
