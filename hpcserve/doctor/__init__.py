"""`hpcserve doctor`: checks of an install (doctor/checks.py, pure) on facts gathered on the
control node and, through a short Slurm job, on a GPU node (doctor/gather.py,
doctor/node_job.py); and the GPU acceptance run (doctor/acceptance.py)."""
