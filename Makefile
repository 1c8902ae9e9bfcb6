# alignflow: `make demo` runs the pipeline on configs/tiny.yaml; `make test` runs the test suite.
# Both create .venv on first use. torch is installed first, pinned (the CPU wheel on CPU-only
# machines; on a GPU machine pip's default index gives the CUDA build of the same version).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/tiny.yaml
PYTEST_ARGS ?=

.PHONY: demo test heavy-test ci-heavy-test triton-compat-test fault-test lint clean-demo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip

# Stamp files: reinstall when pyproject.toml changes. setuptools tells every editable install "Editable
# installation. Please be careful with folders ... same name as your package" (information, not a fault: the
# package-dir mapping needs its import finder); QUIET_PIP keeps `make` output free of it and nothing else.
QUIET_PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install --quiet
$(VENV)/.installed-runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(QUIET_PIP) -e ".[ml]"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-runtime
	$(QUIET_PIP) -e ".[ml,dev]"
	touch $@

demo: $(VENV)/.installed-runtime
	$(BIN)/alignflow run $(CONFIG)

# Unbuffered, so a CI log that is cut off still shows the last test that ran; the slowest tests are listed last.
# The long part of the fault-injection suite (marker `faults`) is left out: `make fault-test` runs it. So are the
# 15 long runs (marker `heavy`, 1-10 min each): `make heavy-test` runs them, and CI runs the three of them
# that nothing shorter covers (CI_HEAVY_TESTS): the compiled decode step through a refit, the pipeline deployed
# on an authenticated Prefect server, S3 and an MLflow server with no credential in any record it leaves (which
# covers the S3 + MLflow-server + registry run's path), and a run started from the Prefect UI and inspected in
# the MLflow UI in a browser.
test: $(VENV)/.installed-dev
	PYTHONUNBUFFERED=1 $(BIN)/python -m pytest --durations=15 -m "not faults and not heavy" $(PYTEST_ARGS)

CI_HEAVY_TESTS = \
	tests/stages/common/generation/test_engine_lifecycle.py::test_compiled_decode_step_matches_eager_and_survives_refit \
	tests/attacks/test_secret_canary.py::test_no_credential_is_written_in_any_record_of_a_pipeline_run \
	tests/ui/test_browser.py::test_run_from_prefect_ui_then_inspect_in_mlflow_ui

# The tests that run on the device `pytest --device cpu|cuda|auto` names (default cpu; README "Development"): the
# kernels (Triton compiled on cuda), the engine, the training forward and LoRA, the DPO losses, the RL algorithms and
# train step. Their tests of CPU-only paths (C++ kernels and decode loop, chunked sampler, prepacking, gloo ranks) skip
# on cuda. On a GPU: make test PYTEST_ARGS='--device cuda $(DEVICE_TESTS)' (single quotes: make expands it).
DEVICE_TESTS = \
	tests/kernels \
	tests/stages/common/generation \
	tests/stages/common/training/test_llama_forward.py \
	tests/stages/common/training/test_lora.py \
	tests/stages/dpo/test_dpo_losses.py \
	tests/stages/ppo/test_losses.py \
	tests/stages/ppo/test_train_shortcuts.py

heavy-test: $(VENV)/.installed-dev
	PYTHONUNBUFFERED=1 $(BIN)/python -m pytest --durations=15 -m heavy $(PYTEST_ARGS)

ci-heavy-test: $(VENV)/.installed-dev
	PYTHONUNBUFFERED=1 $(BIN)/python -m pytest --durations=5 -m heavy $(CI_HEAVY_TESTS) $(PYTEST_ARGS)

# The Triton kernels' tests under the GPU image's Triton (3.6), in its interpreter (scripts/triton_compat_tests.sh).
triton-compat-test: $(VENV)/.installed-dev
	MAIN_VENV=$(VENV) scripts/triton_compat_tests.sh $(PYTEST_ARGS)

# The whole fault-injection suite (tests/faults/, docs/faults.md): S3 faults through a proxy,
# stages killed at seeded random points, a full disk. Needs root for the tmpfs of the disk-full test.
fault-test: $(VENV)/.installed-dev
	PYTHONUNBUFFERED=1 $(BIN)/python -m pytest --durations=40 tests/faults $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

clean-demo:
	rm -rf artifacts mlflow.db mlruns .alignflow

# On a GPU machine (README "On a GPU machine"): `make gpu-wheels` on a networked machine puts into .whl/ the wheels
# the check needs beyond torch, transformers and pyarrow (scripts/gpu_check_wheels.txt, at most 60 MiB); copy the
# checkout over, then `make gpu-check` there: no venv and no network, the machine's $(PYTHON) with its own torch.
# GPU_CHECK_ARGS passes options (--device cpu: the same steps at tiny sizes; --steps, --out, --tests).
GPU_CHECK_ARGS ?=
.PHONY: gpu-check gpu-wheels
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

gpu-wheels:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh --download-wheels

# Build the training image with podman (no Docker engine, no registry: a debootstrap base image) and
# run the SFT stage in it against the host's object store; prints step times and the image size.
# Needs root and minutes of CPU (torch, the DeepSpeed sdist); see containers/README.md.
.PHONY: container-test
container-test: $(VENV)/.installed-runtime
	bash scripts/container_test.sh

# The whole pipeline with every stage in its own container: podman builds the worker, training and
# native-engine images (cached layers), serves the Docker API to a Prefect docker worker, and a run of
# configs/tiny.yaml is deployed, triggered and checked (scripts/container_e2e.py prints the
# stage-to-container table). Needs root; containers/README.md has the times.
.PHONY: container-e2e
container-e2e: $(VENV)/.installed-dev
	bash scripts/container_e2e.sh
