# ftctl: `make demo` runs the main job, `make test` everything CI runs.
# Every target installs what it needs; torch is pinned by constraints.txt so
# pip takes the CPU build on this disk and never a multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt
# Debian packages the integration tests and benchmarks run for real.
DEBS   := etcd-server:etcd prometheus:promtool wrk:wrk man-db:man openssl:openssl

.PHONY: demo test lint unit man bench debs venv dev clean

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

unit: dev
	$(BIN)/pytest -q -n auto tests/unit

test: dev debs lint
	$(BIN)/pytest -q -n auto -p no:cacheprovider

man: dev
	$(BIN)/python -m dynamo_ftctl.cli.manpage man

bench: dev debs
	@for script in benchmarks/*.py; do \
	  echo "== $$script"; $(BIN)/python $$script || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
