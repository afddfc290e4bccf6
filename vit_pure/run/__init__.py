"""Running the training: the flags (cli.py, checks.py) and the frozen settings the
scripts build from them once (settings.py), the backend-aware defaults (backend.py), the
batch and accumulation rules (accum.py), what a script hands the loop (strategy.py), the
loop (loop.py) with its evaluation (evaluate.py) and signals (signals.py), what it
reports (monitor.py), checkpoints (checkpoint.py: the format; checkpoint_arrays.py: how
one array is stored; resume.py: which one a run continues), several processes
(distributed.py) and the host allocator (hostmem.py)."""
