"""Slurm through its command-line tools: one client (client.py), pure parsers (parse.py)."""
