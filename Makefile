# Two entry points the README promises work on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint e2e crd monitoring manifests clean

setup: $(VENV)/.installed

# The images' pinned versions (images/*-constraints.txt) hold here too, so the tests run what the images ship.
# pip's own lines are the progress: a fresh install fetches about 1 GB (torch) and takes a few minutes.
$(VENV)/.installed: pyproject.toml images/operator-constraints.txt images/trainer-constraints.txt
	@echo "setup 1/3: a virtual environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "setup 2/3: the newest pip"
	$(BIN)/pip install --quiet --upgrade pip
	@echo "setup 3/3: the operator, the trainer and their tools as pinned in images/*-constraints.txt (about 1 GB" \
		"with torch, a few minutes the first time)"
	$(BIN)/pip install --progress-bar off -e ".[operator,cli,trainer,tensorboard,mlflow,wandb,images,huggingface,dev]" \
		-c images/operator-constraints.txt -c images/trainer-constraints.txt
	@echo "setup done: $(VENV) holds everything; make demo and make test use it"
	touch $@

# The main job on this machine: the minimal example on CPU (2 processes, 1-2 minutes on 2 cores), one worker
# SIGKILLed at step 260, recovery from the last checkpoint, and the goodput summary.
DEMO_RUN := runs/minimal-cpu
demo: setup
	rm -rf $(DEMO_RUN)
	$(BIN)/trainingrun local manifests/examples/minimal-cpu.yaml --nproc 2 --max-steps 500 --chaos-kill-step 260
	$(BIN)/trainingrun checkpoints file://$(CURDIR)/$(DEMO_RUN)/checkpoints

# The real-API tier (tests/real_api/) runs when KUBEBUILDER_ASSETS names the Kubernetes binaries; by default
# those scripts/install-k8s.sh unpacked into .tools/k8s (it skips, saying how, when there are none).
K8S_ASSETS := $(if $(KUBEBUILDER_ASSETS),$(KUBEBUILDER_ASSETS),$(wildcard $(CURDIR)/.tools/k8s))
# pytest's own temporary folders (tmp_path, kept for the last session to look at) in the clone's .pytest-tmp/, not /tmp:
# `make test` changes nothing outside the clone (.ci/run checks with scripts/leftovers.py).
PYTEST_TEMP := --basetemp=$(CURDIR)/.pytest-tmp
# Each run ends with its 40 slowest tests (setup and teardown apart): where `make test` spends its time.
test: setup
	KUBEBUILDER_ASSETS=$(K8S_ASSETS) $(BIN)/pytest $(PYTEST_TEMP) --durations=40

# A developer's loop: the unit and security tiers without their `slow` tests (each starts processes or servers, or
# takes a second or more; `make test` runs them): under 3 minutes on 2 cores.
test-fast: setup
	$(BIN)/pytest $(PYTEST_TEMP) -m 'not slow and not e2e and not installs' tests/unit tests/security

# Lint and import order (ruff, everything) and types (mypy: strict for the shared package, checked for both sides);
# the settings are in pyproject.toml, and .pre-commit-config.yaml runs the same before each commit.
lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy -p trainingrun_api -p trainingrun_operator -p trainingrun_trainer

# The end-to-end tier (tests/e2e/): a real single-node cluster, Kubeflow, our chart and images; as root.
# Needs the node's packages and the image archives: scripts/install-node.sh, scripts/build-images.sh,
# scripts/e2e-images.sh (bash .ci/run does all of it).
e2e: setup
	bash scripts/install-helm.sh
	bash scripts/install-node.sh
	KUBEBUILDER_ASSETS=$(CURDIR)/.tools/k8s $(BIN)/pytest -m e2e tests/e2e

# Regenerate the committed CRD files after changing operator/trainingrun_operator/api.py.
crd: setup
	$(BIN)/trainingrun crd --write .

# Regenerate manifests/monitoring/ after changing operator/trainingrun_operator/monitoring.py.
monitoring: setup
	$(BIN)/trainingrun monitoring --write .

# Regenerate manifests/operator/ (and the kopf peering CRDs in manifests/crds/) from the Helm chart.
manifests:
	bash scripts/install-helm.sh
	bash scripts/render-manifests.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
