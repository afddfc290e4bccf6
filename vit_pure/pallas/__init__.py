"""Pallas kernels (lowered to Triton for NVIDIA GPUs) for what XLA:GPU cannot fuse.

mlp.py:      fc2 and the GELU before it, forward and backward, as three kernels that never
             write the GELU's output (`--mlp-kernels pallas`).
qkv.py:      the attention's q, k, v projection written straight into cuDNN's padded
             inputs, and its input and bias gradients (`--qkv-projection pallas`).
common.py:   the tile table's rules, the launch order, dispatch; traffic.py: the HBM bytes
             a grid moves; failures.py: a kernel the device refuses, as one line.
Each module runs the same arithmetic on whole arrays in XLA when its program is lowered
for a CPU, and its kernels in Pallas's interpreter for the tests. Not yet timed on a GPU:
opt-in (vit_pure/run/backend.py).

A Pallas primer, as these kernels use it:
- `pl.pallas_call(body, grid=(g0, g1, ...))` runs `body` once per grid point, a
  "program" (a CUDA thread block); `pl.program_id(a)` is its index on axis a. On Triton,
  axis 0 is blockIdx.x, launched fastest, then axis 1 (blockIdx.y, at most 65,535), then
  axis 2: the programs resident together (a wave, about one per SM) are consecutive on
  axis 0. Here axis 0 walks column blocks and the last axis row blocks, so a wave
  shares the large row block it reads from L2.
- `pl.BlockSpec(block_shape, index_map)`: each program sees the block of an operand at
  block index `index_map(*program_ids)` (block units, not elements); a dimension given as
  `pl.squeezed` is dropped from the block.
- The body gets refs, not arrays: `ref[...]` loads the whole block, `ref[rows, cols]`
  with `pl.ds(start, size)` a piece of it (`pl.multiple_of` tells Triton the alignment);
  stores are assignments. Every loaded piece must have power-of-two dimensions.
- `pl_triton.CompilerParams(num_warps, num_stages)`: threads per program (32 a warp) and
  how many iterations of a K loop (`lax.fori_loop`) Triton's software pipeline keeps in
  flight in shared memory; a Python loop is unrolled and not pipelined.
- Inside shard_map every operand of one dot must vary over the same mesh axes
  (`common.vary_alike`, a type cast): the kernel's blocks meet in one dot, and the
  pallas_call's `out_shape` states the mesh-axis type of its outputs.
"""
