"""`hpcserve report`: GPU-hours from Slurm's accounting, tokens from the usage records,
priced at the configured GPU-hour price (compute.py: the figures; render.py: the outputs;
cli.py: the command)."""
