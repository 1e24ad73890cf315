# gangserve: `make serve` starts the service, `make test` runs the suite. Both install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_FLAGS := --disable-pip-version-check -q

.PHONY: install serve test bench lint clean

install: $(STAMP)

# Re-install whenever the pins or the project metadata change.
$(STAMP): constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/serve run deployments/local.yaml

test: $(STAMP)
	$(PY) -m pytest tests -v --durations=15

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .gangserve .pytest_cache
