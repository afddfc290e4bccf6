"""Reading what XLA will run: the HLO text of a compiled program (hlo.py), a GPU program's
kernels and HBM traffic (kernels.py), and the model's matmul FLOPs counted from its shapes
(flops.py)."""
