# `make demo` and `make test` work on a fresh machine: each creates .venv when missing and
# installs what it needs (the stamp file re-runs the install when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test typecheck lint bench bench-deps bench-tests clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/iosched demo

# The tests run on every core (pytest-xdist, -n auto); the tests that share a corpus built once,
# or that change the machine's state (loop devices), carry an xdist_group mark and run on one
# worker each (--dist loadgroup). The tests of the benchmark against fio (marked bench) are
# `make bench-tests`'s. One file or test runs best in-process:
# `.venv/bin/python -m pytest tests/test_store.py`.
PYTEST_WORKERS ?= -n auto --dist loadgroup

# The types (mypy --strict) are checked alongside the tests: the tests leave the cores idle
# while they wait on the disk, on sleeps and on subprocesses, and mypy (~40 s from no cache, on
# one core) fills that; its report follows the tests', and either failing fails the target.
# Then the layer contracts (lint-imports reads [tool.importlinter] in pyproject.toml;
# docs/design.md, "Import rules") and the lint (ruff).
test: $(STAMP)
	@echo "$(BIN)/python -m mypy > $(VENV)/mypy.log (alongside the tests)"
	@$(BIN)/python -m mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	echo '$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "not bench"'; \
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "not bench"; tests=$$?; \
	wait $$mypy; types=$$?; echo "$(BIN)/python -m mypy:"; cat $(VENV)/mypy.log; \
	[ $$tests -eq 0 ] && [ $$types -eq 0 ]
	$(BIN)/lint-imports
	$(BIN)/ruff check .

# The benchmark's own set-up: fio from Debian is the reference every row is compared with.
# Without root (or a registry) it says so, and the tests comparing with fio skip with that reason.
bench-deps:
	@command -v fio >/dev/null || (apt-get update -qq && apt-get install -y -qq fio >/dev/null) \
		|| echo "fio could not be installed (apt-get install fio): fio comparisons will be skipped"

# The benchmark's tests: `iosched bench` against fio (pytest -m bench; seconds).
bench-tests: $(STAMP) bench-deps
	$(BIN)/python -m pytest -q -m bench

# The sweep behind docs/benchmarks.md (about 10 minutes on 2 cores), after the benchmark's tests.
bench: $(STAMP) bench-deps bench-tests
	$(BIN)/iosched bench --sweep --backends pread,odirect,mmap,uring,naive \
		--bs-list 64K,1M,4M,16M --qd-list 1,4,16,64 --seconds 1 --reps 3 --fio \
		--plot docs/img/bench-sweep.png

typecheck: $(STAMP)
	$(BIN)/python -m mypy

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
