"""The communication plan (`--plan N`): what a training step will cost on a mesh you do not
have. build.py compiles the step and reads its collectives; interconnect.py prices them."""
