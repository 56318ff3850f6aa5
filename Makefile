# `make demo` and `make test` work on a fresh machine: they create (or reuse)
# .venv, install what is needed, build the extension, then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEPS_STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
RUST_SOURCES := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml Cargo.lock pyproject.toml

.PHONY: demo test build cargo-test pytest stubtest bench wheel clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(DEPS_STAMP): $(PY) requirements-dev.txt constraints-dev.txt
	$(PIP) install --quiet -r requirements-dev.txt -c constraints-dev.txt
	touch $@

$(BUILD_STAMP): $(DEPS_STAMP) $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/maturin develop --release --quiet
	touch $@

build: $(BUILD_STAMP)

demo: build
	$(PY) -m ferrobatch demo

cargo-test:
	cargo test --quiet

stubtest: build
	$(PY) -m mypy.stubtest ferrobatch._core

pytest: build
	$(PY) -m pytest -q

test: build cargo-test stubtest pytest

bench: build
	cargo bench
	$(PY) benches/python/bench_e2e.py
	$(PY) benches/python/bench_submit.py

wheel:
	$(VENV)/bin/maturin build --release --out dist

clean:
	rm -rf target dist $(VENV)
