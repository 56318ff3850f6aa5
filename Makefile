# `make demo` and `make test` work on a fresh machine: they create (or reuse)
# .venv, install what is needed, build the extension, then run. Installs are
# quiet and happen only when requirements-dev.txt, constraints-dev.txt or the
# sources change (the stamps below), so a second run goes straight to the point.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --quiet --disable-pip-version-check
DEPS_STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
RUST_SOURCES := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml Cargo.lock pyproject.toml python/ferrobatch/grpc/grpc_predict_v2.proto
SERVING_TESTS := tests/test_http.py tests/test_grpc.py tests/test_serve.py
# tritonclient caps protobuf below 7, so the pins take protobuf 6; the serving
# tests run again on this one, laid over the venv's (PYTHONPATH), which stays as is.
PROTOBUF_NEXT := 7.36.2
PROTOBUF_NEXT_DIR := $(VENV)/protobuf-next

.PHONY: demo test build cargo-test pytest stubtest lint lint-rust lint-python pytest-protobuf-next bench wheel clean miri loom
.PHONY: bench-serve bench-serve-deps bench-tools

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes torch (the pinned version)
# from that index: CPU-only, a far smaller venv. Its dependencies still come from PyPI.
TORCH_INDEX ?=

$(DEPS_STAMP): $(PY) requirements-dev.txt constraints-dev.txt
	$(if $(TORCH_INDEX),$(PIP) install --no-deps --index-url $(TORCH_INDEX) -c constraints-dev.txt torch)
	$(PIP) install -r requirements-dev.txt -c constraints-dev.txt
	touch $@

# PIP_QUIET: maturin installs the package's dependencies with pip, which would
# otherwise list every one as "Requirement already satisfied".
$(BUILD_STAMP): $(DEPS_STAMP) $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH PIP_QUIET=1 $(VENV)/bin/maturin develop --release --quiet
	touch $@

build: $(BUILD_STAMP)

demo: build
	$(PY) -m ferrobatch demo

# The core (the workspace's default member) and the native front-end; the pyo3
# binding is tested through Python.
cargo-test:
	cargo test --quiet
	cargo test --quiet -p ferrobatch-serve

stubtest: build
	$(PY) -m mypy.stubtest ferrobatch._core

# The Ray tests in a process of their own, which their one Ray cluster's
# threads leave with it (see tests/conftest.py's ray_session).
pytest: build
	$(PY) -m pytest -q -m "not ray"
	$(PY) -m pytest -q -m ray

test: build cargo-test stubtest pytest

# The serving suite on the next protobuf major (what the generated gRPC code
# must also load on), beside tritonclient.
pytest-protobuf-next: build
	$(PIP) install --no-deps --upgrade --target $(PROTOBUF_NEXT_DIR) protobuf==$(PROTOBUF_NEXT)
	PYTHONPATH=$(abspath $(PROTOBUF_NEXT_DIR)) $(PY) -c \
		'import google.protobuf as p, sys; print("protobuf", p.__version__); sys.exit(p.__version__ != "$(PROTOBUF_NEXT)")'
	PYTHONPATH=$(abspath $(PROTOBUF_NEXT_DIR)) $(PY) -m pytest -q $(SERVING_TESTS)

lint: lint-rust lint-python

lint-rust: $(PY)
	cargo fmt --all --check
	PYO3_PYTHON=$(abspath $(PY)) cargo clippy --quiet --workspace --all-targets -- -D warnings

# The generated gRPC code must be what the proto generates (_codegen.py --check).
lint-python: $(DEPS_STAMP)
	$(VENV)/bin/ruff format --check --quiet --output-format concise
	$(VENV)/bin/ruff check --quiet
	$(PY) -m mypy
	$(PY) python/ferrobatch/grpc/_codegen.py --check

# The core's unsafe code (staging ring, queue, request state) under Miri: their
# unit tests, with smaller iteration counts under cfg(miri) (about a minute).
# Where the nightly toolchain has no Miri component, says so and succeeds.
MIRI_TESTS := staging:: request:: queue:: batcher:: inbox:: pending::
miri:
	@if cargo +nightly miri --version >/dev/null 2>&1; then \
		cargo +nightly miri setup --quiet && \
		cargo +nightly miri test --quiet --lib -- $(MIRI_TESTS); \
	else \
		echo "make miri: skipped: Miri is not installed (rustup component add --toolchain nightly miri)"; \
	fi

# Loom models of the request state transitions and the staging ring's
# acquire/release: every interleaving (a few seconds). Their own target dir,
# so --cfg loom does not rebuild the usual one.
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --quiet --release --lib -- loom_

# The v2 decoder (FUZZ_TARGET=decode) or a live shared segment scribbled
# while served (FUZZ_TARGET=shm), or a varying model's cells (FUZZ_TARGET=shm_cells),
# under libFuzzer (cargo-fuzz on nightly) for
# FUZZ_SECONDS, starting from rust/fuzz/seeds/$(FUZZ_TARGET) where it exists;
# installs cargo-fuzz if it is missing. Findings land in rust/fuzz/artifacts.
FUZZ_SECONDS ?= 60
FUZZ_TARGET ?= decode
.PHONY: fuzz
fuzz:
	@command -v cargo-fuzz >/dev/null 2>&1 || cargo install --locked cargo-fuzz
	mkdir -p rust/fuzz/corpus/$(FUZZ_TARGET)
	cargo +nightly fuzz run --fuzz-dir rust/fuzz $(FUZZ_TARGET) rust/fuzz/corpus/$(FUZZ_TARGET) \
		$(wildcard rust/fuzz/seeds/$(FUZZ_TARGET)) -- -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048

bench: build bench-serve-deps
	cargo bench
	cargo bench -p ferrobatch-serve --bench grpc
	$(PY) benches/python/bench_e2e.py
	$(PY) benches/python/bench_submit.py
	$(PY) benches/python/bench_serve.py

# The serving bench drives the servers with wrk and h2load (Debian's wrk and
# nghttp2-client) and compares with PyTriton, which pins numpy < 2 and so has a
# venv of its own; that venv sees .venv's packages after its own (torch, and
# ferrobatch for the same demo MLP) through a .pth file.
# make bench-serve BENCH_SERVE_ARGS="--runs 1 --servers ferrobatch", say.
PYTRITON_VENV := .venv-pytriton
PYTRITON_STAMP := $(PYTRITON_VENV)/.stamp
PYTRITON_VERSION := 0.7.0
BENCH_SERVE_ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

bench-tools:
	@command -v wrk >/dev/null && command -v h2load >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq wrk nghttp2-client; }

$(PYTRITON_STAMP): | $(PY)
	$(PYTHON) -m venv $(PYTRITON_VENV)
	$(PYTRITON_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		nvidia-pytriton==$(PYTRITON_VERSION) "numpy<2"
	$(PY) -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
		> "$$($(PYTRITON_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ferrobatch_venv.pth"
	touch $@

bench-serve-deps: bench-tools $(PYTRITON_STAMP)

bench-serve: build bench-serve-deps
	$(PY) benches/python/bench_serve.py $(BENCH_SERVE_ARGS)

wheel: $(DEPS_STAMP)
	$(VENV)/bin/maturin build --release --quiet --out dist

clean:
	rm -rf target dist $(VENV) $(PYTRITON_VENV)
