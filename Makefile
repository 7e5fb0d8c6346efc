# The two commands of the README. Everything else they need, they set up themselves.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Interpreters found by scripts/toxenvs.py are linked here so tox can find them.
export PATH := $(CURDIR)/.runtime/pythons:$(PATH)

.PHONY: test test-all test-galera bench services-up services-down docs package clean

test: $(STAMP) package
	@$(MAKE) --no-print-directory tox ENVS="$$($(VENV)/bin/python scripts/toxenvs.py default)"
	@$(MAKE) --no-print-directory test-galera

test-all: $(STAMP) package
	@$(MAKE) --no-print-directory tox ENVS="$$($(VENV)/bin/python scripts/toxenvs.py all)"
	@$(MAKE) --no-print-directory test-galera

# The `galera` group (tests/test_galera.py) on a 3-node Galera cluster, in .venv's Django:
# cluster up, the group, cluster down again whatever the result. A cluster that does not
# start fails the target (never a group of skipped tests): `services.py` exits non-zero,
# and the tests stop at once when KVCACHE_REQUIRE_SERVERS' servers do not answer.
test-galera: $(STAMP)
	env="$$($(VENV)/bin/python scripts/services.py galera up)" || { \
	    $(VENV)/bin/python scripts/services.py galera down; exit 1; }; \
	eval "$$env"; \
	rc=0; KVCACHE_REQUIRE_SERVERS=galera $(VENV)/bin/python -m pytest -p no:cacheprovider \
	    -m galera tests/test_galera.py $(PYTEST_ARGS) || rc=$$?; \
	$(VENV)/bin/python scripts/services.py galera down; exit $$rc

# The sdist and wheel build, install in fresh venvs and import (no servers needed).
package: $(STAMP)
	$(VENV)/bin/python scripts/check_package.py

# Servers up, tox, servers down again whatever tox's result; servers that do not start
# fail it (as for test-galera), and so does any group services.py started (the shard
# servers and the replica unless their ports are set empty) missing when tests start.
# Each environment takes the tests in a new order (pytest-randomly) and prints its seed:
# PYTEST_ARGS="-p no:cacheprovider -p randomly --randomly-seed=N" replays one.
tox:
	@test -n "$(ENVS)"
	env="$$($(VENV)/bin/python scripts/services.py up)" || { \
	    $(VENV)/bin/python scripts/services.py down; exit 1; }; \
	eval "$$env"; \
	export KVCACHE_REQUIRE_SERVERS="mysql,memcached$${KVCACHE_MYSQL_SHARD_PORTS:+,shards}$${KVCACHE_MYSQL_REPLICA_PORT:+,replica}"; \
	rc=0; $(VENV)/bin/tox run -e "$(ENVS),docs" -- $(PYTEST_ARGS) || rc=$$?; \
	$(VENV)/bin/python scripts/services.py down; exit $$rc

# Realistic payloads first, then the heavy mix (issue 23's targets hold on both), incompressible
# bytes last; BENCH_VALUES=realistic overrides.
BENCH_VALUES ?= realistic,heavy,random
# The shards scenario caps each shard server at this share of a core where the cgroup v1
# cpu controller is writable (else it says so and runs them uncapped); async measures both
# backends' asyncio APIs against one sync_to_async hop and the peers' async methods.
BENCH_SERVER_CPU ?= 0.12
# The scale scenario (issue 41) at 100 k entries: a minute here. The 1 M tier adds about
# five minutes (three 1 M-row tables filled, 6 GB): BENCH_SCALE_ROWS=100000,1000000. The
# 10 M tier (BENCH_SCALE_ROWS=100000,1000000,10000000, ours alone at 10 M) took 32 minutes
# in all at a load of 3-10, 14 of them filling its 11 GiB table; 18 GB of tables on disk.
BENCH_SCALE_ROWS ?= 100000

bench: $(STAMP)
	mkdir -p results
	env="$$($(VENV)/bin/python scripts/services.py up)" || { \
	    $(VENV)/bin/python scripts/services.py down; exit 1; }; \
	eval "$$env"; \
	rc=0; $(VENV)/bin/python benchmark_app/manage.py kvcache_benchmark --values $(BENCH_VALUES) \
	    --scenario default,shards,async,scale --server-cpu $(BENCH_SERVER_CPU) \
	    --scale-rows $(BENCH_SCALE_ROWS) $(BENCH_ARGS) || rc=$$?; \
	$(VENV)/bin/python scripts/services.py down; exit $$rc

# __init__.py holds the version, which the installed metadata (pip list) repeats.
$(STAMP): setup.cfg pyproject.toml scripts/services.py django_kvcache/__init__.py
	$(PYTHON) scripts/services.py deps
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[mysql,memcached,zstd,bench,prometheus,encrypt,dev,docs]'
	touch $@

services-up: $(STAMP)
	$(VENV)/bin/python scripts/services.py up

services-down:
	$(PYTHON) scripts/services.py down

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W -q -b html docs docs/_build/html

clean:
	-$(PYTHON) scripts/services.py down
	-$(PYTHON) scripts/services.py galera clean
	rm -rf $(VENV) .tox .runtime docs/_build results
