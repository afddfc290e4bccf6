"""The communication plan (`--plan N`): what a training step will cost on a mesh you do not
have. build.py reads the plan out of the script's step compiled for N devices (the method in
its docstring; vit_pure/run/planning.py builds and compiles the step); collectives.py reads
the compiled program's collectives; overlap.py marks which of them the compute can hide;
interconnect.py prices them on cited, message-size-aware curves; report.py puts it together
as text and JSON; targets.py and targets/ describe the GPUs it compiles for without one."""
