"""The layers an encoder block is made of, each behind one call that `model._block` makes.

    norm.py       LayerNorm with float32 statistics (a custom VJP that keeps x and two
                  float32 numbers a token)
    linear.py     bias adds whose gradients sum in float32; `varying_like`, the cast that
                  gives a parameter the mesh type of the activation it meets
    attention.py  self-attention: the einsum reference and JAX's fused attention ("xla",
                  "cudnn"); attention_pallas.py, the kit's own kernel (Mosaic GPU)
    mlp.py        fc2(GELU(fc1 x)): the GELU in the matmul dtype, in fc1's epilogue
    dropout.py    dropout and stochastic depth, each mask drawn from its example's key
    remat.py      what a rematerialised block keeps for its backward pass
None of them emits a collective: tensor parallelism's two operators live in model.py.
"""
