# gangserve: `make serve` starts the service, `make test` runs the suite. Both install first:
# `make install` (and `make serve`) the service and the client only; `make test` adds the test
# extra (pytest, schemathesis, hypothesis, tritonclient, moto, playwright, hadolint) and, as
# root, Debian's chromium and postgresql for the browser and state-database tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
PIP_FLAGS := --disable-pip-version-check -q
# A CPU host: `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes torch's CPU
# build (a 0.2 GB download instead of CUDA's several GB) at its pin first, as the Dockerfile does.
TORCH_INDEX ?=

.PHONY: install install-test serve test test-unit bench docs lint clean chromium postgresql

install: $(STAMP)

install-test: $(TEST_STAMP) chromium postgresql

# Re-install whenever the pins or the project metadata change. The client distribution
# (./clients, gangserve-client) is a dependency of the project found on no index: it is
# installed from this repository in the same pip run, both editable, both under the pins.
$(STAMP): constraints.txt pyproject.toml clients/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if [ -n "$(TORCH_INDEX)" ]; then $(PY) -m pip install $(PIP_FLAGS) --index-url "$(TORCH_INDEX)" "$$(grep '^torch==' constraints.txt)"; fi
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e ./clients -e .
	touch $(STAMP)

# The test extra on top of the service (re-run whenever the service install is).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e ./clients -e '.[test]'
	touch $(TEST_STAMP)

# The status page's browser test (tests/test_ui.py) drives Debian's chromium through Playwright
# (never a browser download of its own). Installed here when missing and we can (root, apt-get);
# otherwise that test says why it is skipped.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium (apt-get) for tests/test_ui.py"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
	    || echo "could not install chromium: tests/test_ui.py will be skipped"; \
	fi

# The state-database tests (tests/postgres.py) run a real PostgreSQL server (initdb + postgres
# from /usr/lib/postgresql/*/bin, on a loopback port). Debian's postgresql is installed here when
# missing and we can (root, apt-get); otherwise those tests say why they are skipped.
postgresql:
	@if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing postgresql (apt-get) for the state-database tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q postgresql >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q postgresql >/dev/null; } \
	    || echo "could not install postgresql: the PostgreSQL state-database tests will be skipped"; \
	fi

# The front door (service/cluster/front_door.py): Serve's HAProxy on port 8000, straight to
# the Ingress replicas. Read when Ray starts, so `serve run` gets them in its environment.
FRONT_DOOR_ENV := RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_ENABLE_DIRECT_INGRESS=1

serve: $(STAMP)
	env $(FRONT_DOOR_ENV) $(VENV)/bin/serve run deployments/local.yaml

# Two pytest runs side by side: the Ray tests (one cluster, one process, `-v`), and the unit
# tests beside them, their output printed after (harness/suite.py).
test: $(TEST_STAMP) chromium postgresql
	$(PY) -m harness.suite

test-unit: $(TEST_STAMP)
	$(PY) -m pytest tests -m unit -q

# bench/llama.py compares model=llama with transformers' own LlamaModel: the test extra has it.
# bench/decode.py: the decode step against the memory floor (both stacks, world sizes 1 and 2).
bench: $(TEST_STAMP)
	$(PY) bench/run.py
	$(PY) bench/run.py --only sessions
	$(PY) bench/run.py --only models
	$(PY) bench/run.py --only grpc
	$(PY) bench/llama.py
	$(PY) bench/decode.py

# The builder-argument, tunables and environment references are generated from their declarations,
# docs/api.md's error table from the error-code registry (service/contract/errors.py), and its gRPC
# status table from the same registry (service/ingress/oip_grpc/status.py).
docs: $(STAMP)
	$(PY) -m service.config.builder_args > docs/builder-arguments.md
	$(PY) -m service.config.tunables > docs/tunables.md
	$(PY) -m service.environment > docs/environment.md
	$(PY) -m service.contract.errors --update docs/api.md
	$(PY) -m service.ingress.oip_grpc.status --update docs/api.md

clean:
	rm -rf $(VENV) .gangserve .pytest_cache
