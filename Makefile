# gangserve: `make serve` starts the service, `make test` runs the suite. Both install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_FLAGS := --disable-pip-version-check -q

.PHONY: install serve test test-unit bench lint clean

install: $(STAMP)

# Re-install whenever the pins or the project metadata change. The client distribution
# (./clients, gangserve-client) is a dependency of the project found on no index: it is
# installed from this repository in the same pip run, both editable, both under the pins.
$(STAMP): constraints.txt pyproject.toml clients/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e ./clients -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/serve run deployments/local.yaml

test: $(STAMP)
	$(PY) -m pytest tests -v --durations=15

test-unit: $(STAMP)
	$(PY) -m pytest tests -m unit -q

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .gangserve .pytest_cache
