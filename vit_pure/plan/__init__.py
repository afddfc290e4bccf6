"""The communication plan (`--plan N`): what a training step will cost on a mesh you do not
have. build.py compiles the script's step for N devices (the entry, and the method in its
docstring); collectives.py reads the compiled program's collectives; overlap.py marks which
of them the compute can hide; interconnect.py prices them on cited, message-size-aware
curves; report.py puts it together as text and JSON; targets.py and targets/ describe the
GPUs it compiles for without one."""
