"""The layers an encoder block is made of, each behind one call that `model._block` makes.

    norm.py       LayerNorm with float32 statistics (a custom VJP that keeps x and two
                  float32 numbers a token)
    linear.py     bias adds whose gradients sum in float32; `varying_like`, the cast that
                  gives a parameter the mesh type of the activation it meets
    attention.py  self-attention: the einsum reference, JAX's fused attention ("xla",
                  "cudnn") and the Pallas q, k, v projection that feeds it
    mlp.py        fc2(GELU(fc1 x)): the GELU in the matmul dtype, or the Pallas kernels
    dropout.py    dropout and stochastic depth, each mask drawn from its example's key
    remat.py      what a rematerialised block keeps for its backward pass

None of them emits a collective: tensor parallelism's two operators live in model.py,
around these calls. The kernels themselves (Triton, through Pallas) are in ../pallas/.
"""
