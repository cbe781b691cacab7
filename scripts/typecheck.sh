#!/usr/bin/env bash
# Type-check the product packages with mypy (config: pyproject.toml [tool.mypy]).
# The components are top-level folders mapped into the `hpcserve` package at install time
# (pyproject's package-dir), which mypy cannot follow: it checks a tree of symlinks laid out
# as the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/hpcserve"
for f in hpcserve/*; do ln -s "$root/$f" "$tree/hpcserve/"; done
for d in contracts slurm router gateway poolmgr engine_launch health modelcache sim slurm_templates; do
  ln -s "$root/$d" "$tree/hpcserve/$d"
done
cd "$tree"
exec "$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/build/mypy-cache" -p hpcserve
