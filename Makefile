# The two commands of README.md, and a few for developers.
VENV ?= .venv
STATE ?= .state

.PHONY: up down test lint bootstrap status bench clean

up: bootstrap
	$(VENV)/bin/hpcserve up --state-dir $(STATE)

down:
	@if [ -x $(VENV)/bin/hpcserve ]; then $(VENV)/bin/hpcserve down --state-dir $(STATE); \
	else echo "nothing to stop: no $(VENV)"; fi

test: bootstrap
	$(VENV)/bin/ruff check .
	scripts/typecheck.sh
	$(VENV)/bin/pytest

lint: bootstrap
	$(VENV)/bin/ruff check .
	scripts/typecheck.sh
	$(VENV)/bin/ruff format --check hpcserve contracts slurm router gateway poolmgr engine_launch health sim modelcache

status: bootstrap
	$(VENV)/bin/hpcserve status --config $(STATE)/hpcserve.toml

# Every benchmark of bench/suite.py, bounded (under 10 minutes on 2 cores), into
# docs/benchmarks.md and docs/img/.
bench: bootstrap
	$(VENV)/bin/python bench/suite.py

bootstrap:
	@scripts/bootstrap.sh

clean: down
	rm -rf $(STATE)
