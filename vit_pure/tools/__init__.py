"""Small command-line tools: `python -m vit_pure.tools.plot` (a run's curves) and
`python -m vit_pure.tools.params_table` (the parameter table)."""
