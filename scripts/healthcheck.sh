#!/bin/sh
# Slurm's HealthCheckProgram for GPU nodes, running hpcserve's checks through the real NVML
# (nvidia-ml-py) and DCGM where it is installed. In slurm.conf:
#
#   HealthCheckProgram=/opt/hpcserve/scripts/healthcheck.sh
#   HealthCheckInterval=300
#   HealthCheckNodeState=ANY,CYCLE
#
# slurmd runs it as root on every node; a finding whose action is drain drains the node with
# a reason such as "hpcserve: xid 79 gpu 3"; with health.auto_resume_after = N in the config
# it resumes nodes hpcserve drained after N clean checks (never an admin's drain). It must
# finish well inside Slurm's 60 s: one pass takes about a second plus --xid-window-s.
#
# By hand, to see what NVML reads on this node (no Slurm needed, nothing drained):
#
#   hpcserve health check -v
#
# The node is named by $SLURMD_NODENAME, else the short hostname: where Slurm's NodeName
# differs from it, add --node NAME below.
#
# Set HPCSERVE=/path/to/hpcserve and HPCSERVE_CONFIG=/path/to/hpcserve.toml in the
# environment of slurmd, or edit the defaults below.
: "${HPCSERVE:=/opt/hpcserve/.venv/bin/hpcserve}"
: "${HPCSERVE_CONFIG:=/etc/hpcserve/hpcserve.toml}"
export HPCSERVE_CONFIG
exec "$HPCSERVE" health check --drain --xid-window-s 2 "$@"
