# Two entry points the README promises work on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup demo test crd clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[operator,trainer,dev]"
	touch $@

# Until the local runner exists, the demo validates the examples and shows what a run becomes.
demo: setup
	$(BIN)/trainingrun validate manifests/examples/*.yaml
	$(BIN)/trainingrun render manifests/examples/minimal-cpu.yaml

test: setup
	$(BIN)/pytest

# Regenerate the committed CRD files after changing operator/trainingrun_operator/api.py.
crd: setup
	$(BIN)/trainingrun crd --write .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
