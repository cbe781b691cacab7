"""GPU and engine health checks (NVML/DCGM) that drain faulty nodes in Slurm.

Not built yet: issue 7 owns this package. The walking skeleton only keeps the
folder so the layout matches docs/architecture.md.
"""
