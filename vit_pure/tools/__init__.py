"""Small command-line tools: `python -m vit_pure.tools.plot` (a run's curves),
`python -m vit_pure.tools.params_table` (the parameter table),
`python -m vit_pure.tools.export` (a checkpoint as Hugging Face or timm weights) and
`python -m vit_pure.tools.price_collective` (one collective priced as the plan prices it)."""
