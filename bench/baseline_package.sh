#!/bin/sh
# The hpcserve package as of git revision REV, installed into DIR (its compiled parts built),
# for bench/proxy_overhead.py --baseline DIR: the gateway of that commit measured beside this
# checkout's in the same rounds.
#
#     bench/baseline_package.sh HEAD~1 /tmp/hpcserve-base
set -eu
if [ $# -ne 2 ]; then
    echo "usage: $0 REV DIR" >&2
    exit 2
fi
rev=$1
dir=$2
root=$(cd "$(dirname "$0")/.." && pwd)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git -C "$root" archive "$rev" | tar -x -C "$tree"
rm -rf "$dir"
"$root/.venv/bin/pip" install -q --no-deps --no-build-isolation --target "$dir" "$tree"
echo "$dir: hpcserve as of $(git -C "$root" rev-parse --short "$rev")"
