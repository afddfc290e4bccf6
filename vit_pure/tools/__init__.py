"""Small command-line tools: `python -m vit_pure.tools.plot` (a run's curves),
`python -m vit_pure.tools.params_table` (the parameter table) and
`python -m vit_pure.tools.export` (a checkpoint as Hugging Face or timm weights)."""
