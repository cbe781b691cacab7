#!/usr/bin/env bash
# The GPU acceptance run (docs/gpu-acceptance.md): on one GPU machine, unattended and
# offline, it checks the GPUs through the real NVML, then serves a tiny random-weight model
# on vLLM's GPU build through the whole stack (gateway -> router -> engine) with TP=1 and,
# where there are 2+ GPUs, TP=2: chat and streamed completions, KV-cache events reaching the
# router, and a drain under load. It prints a line per verified step and exits non-zero on
# any failure.
#
#   scripts/gpu-acceptance.sh [--cpu] [--venv DIR] [--work-dir DIR] [--timeout SECONDS]
#
# --cpu: the same run on vLLM's CPU build (TP=1; NVML and TP=2 reported as skipped), what
# the test suite runs on machines without a GPU. The venv (default: .venv, or
# $HPCSERVE_VENV) must hold hpcserve[gpu] (or hpcserve[cpu] for --cpu), prepared beforehand:
# nothing is downloaded. Bounded: the run gives up after --timeout (default 480 s), and this
# script stops it 60 s later whatever it is doing; either way the stack it started is
# stopped (`hpcserve down`).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${HPCSERVE_VENV:-.venv}
mode=--gpu
work=""
timeout_s=480
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) mode=--cpu ;;
    --venv) venv=$2; shift ;;
    --work-dir) work=$2; shift ;;
    --timeout) timeout_s=$2; shift ;;
    *) echo "usage: $0 [--cpu] [--venv DIR] [--work-dir DIR] [--timeout SECONDS]" >&2; exit 2 ;;
  esac
  shift
done

hpcserve="$venv/bin/hpcserve"
if [ ! -x "$hpcserve" ]; then
  echo "gpu-acceptance: no hpcserve in $venv (prepare the venv first: docs/gpu-acceptance.md)" >&2
  exit 2
fi
if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "gpu-acceptance: vLLM does not import in $venv (pip install 'hpcserve[gpu]')" >&2
  exit 2
fi

# Offline: no model hub, no usage reports.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

work=${work:-$(mktemp -d "${TMPDIR:-/tmp}/hpcserve-acceptance.XXXXXX")}
mkdir -p "$work"
echo "gpu-acceptance: $mode, working in $work (logs: $work/state/logs, $work/state/jobs)"
# Whatever happens, leave no service or engine behind.
trap '"$hpcserve" down --state-dir "$work/state" >/dev/null 2>&1 || true' EXIT

status=0
timeout --kill-after=30 $((timeout_s + 60)) \
  "$hpcserve" doctor "$mode" --work-dir "$work" --timeout "$timeout_s" || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "gpu-acceptance: FAIL: the run did not finish within $((timeout_s + 60)) s" >&2
fi
exit "$status"
