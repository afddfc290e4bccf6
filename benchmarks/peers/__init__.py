"""The kit's training step against Flax NNX and PyTorch, same ViT, one device:
`python -m benchmarks.peers --help` (driver.py's docstring) says what it runs and prints.

    driver.py     the parent: flags, one child process per row, rounds, the table
    kit.py        the JAX children: the ceiling matmul, the kit's rows, its profile
    flax_nnx.py   the Flax NNX child: the ViT in NNX, optax AdamW
    pytorch.py    the PyTorch child: the ViT as an nn.Module, eager or torch.compile
    common.py     what the children share: the recipe's constants, the child's side of
                  the runner (no JAX: the PyTorch child imports neither JAX nor the kit)
"""
