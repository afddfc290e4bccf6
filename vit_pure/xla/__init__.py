"""Reading what XLA will run: FLOPs of the model (flops.py)."""
