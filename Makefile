# rankwatch: `make demo` runs the example job end to end on the built-in local cluster,
# `make test` runs every test (lint, unit, e2e on the local cluster).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install native demo test lint format unit e2e e2e-rbac bench bench-fuzz image-rootfs cluster-binaries tools monitoring kueue torch-env cluster-up cluster-down cluster-status clean

$(INSTALLED): pyproject.toml analysis/_megatrace_tokenizer.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(INSTALLED)

# The NCCL tracing library (for glibc 2.17, with zig from the venv's ziglang), stand-in NCCL/CUDA and
# drivers (gcc).
native: $(INSTALLED)
	$(MAKE) -s -C nccl_patch

# Kubernetes, etcd and kwok from their Go modules; cached by version outside the repository.
cluster-binaries: $(INSTALLED)
	$(BIN)/rankwatch cluster build

# helm and promtool for the chart and rules tests (tests/deploy), the JobSet controller, Kubeflow
# Trainer and the training-operator (PyTorchJob) for the other kinds' e2e tests; cached like the
# cluster binaries.
tools: $(INSTALLED)
	$(BIN)/rankwatch cluster build --tools

# Prometheus and Alertmanager for the local monitoring stack (`rankwatch cluster up --monitoring`,
# tests/e2e/test_monitoring.py); cached like the cluster binaries.
monitoring: $(INSTALLED)
	$(BIN)/rankwatch cluster build --monitoring

# The Kueue controller (gang admission) for the queued-TrainingJob tests (`rankwatch cluster up --kueue`,
# tests/e2e/test_gang_admission.py); cached like the cluster binaries.
kueue: $(INSTALLED)
	$(BIN)/rankwatch cluster build --kueue

# PyTorch from PyPI for the real-PyTorch tests (tests/realtorch): cached by version outside the repository.
torch-env: $(INSTALLED)
	$(BIN)/python tests/support/torch_env.py

cluster-up: cluster-binaries
	$(BIN)/rankwatch cluster up

cluster-down: $(INSTALLED)
	$(BIN)/rankwatch cluster down

cluster-status: $(INSTALLED)
	$(BIN)/rankwatch cluster status

demo: cluster-binaries tools monitoring
	bash examples/demo.sh

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(INSTALLED)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

unit: $(INSTALLED)
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

e2e: cluster-binaries
	$(BIN)/pytest tests/e2e $(PYTEST_ARGS)

# pytest exits 5 when a selection (PYTEST_ARGS="-k ...") collects nothing: not a failure.
# TEST_WORKERS="-n 2 --dist loadgroup --no-loadscope-reorder": two pytest-xdist workers, the e2e tests
# (one group, tests/conftest.py) on one while the other runs the CPU-bound tests (23 min instead of 31,
# but the e2e tests' detectors then run on a loaded machine; see docs/tests.md). Serial by default.
TEST_WORKERS ?=
test: lint native cluster-binaries tools monitoring kueue torch-env
	$(BIN)/pytest tests $(TEST_WORKERS) --durations=30 $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest: no tests collected"; status=0; fi; \
	if [ $$status -eq 0 ] && [ -z "$(PYTEST_ARGS)" ]; then $(MAKE) --no-print-directory e2e-rbac || status=$$?; fi; \
	exit $$status

# The operator's e2e flows again (jobs, diagnosis, cordoning), run as the Helm chart's ServiceAccount
# instead of admin: the chart's RBAC is enough for everything the operator does. Left to the admin run:
# variants that use the same verbs (dry run, a slow link's two cordons, untimed, stuck, healthy) and the
# tests that never reach the session operator (an operator process of their own, or no operator at all),
# which would run as admin here too.
E2E_RBAC_SKIP = healthy or restarted or without_gpu_timing or stuck or dry-run or slow_pipeline_link or uvloop \
	or pending_jobs_pod_names or bounded_few_at_a_time
e2e-rbac: cluster-binaries tools
	RANKWATCH_E2E_SERVICE_ACCOUNT=1 $(BIN)/pytest tests/e2e/test_trainingjob.py tests/e2e/test_diagnosis.py \
		-k "not ($(E2E_RBAC_SKIP))"

# Each bench prints its headline figures as FIGURE lines; bench/check_results.py compares them with
# RESULTS.md ("Headline figures"): `make bench | tee bench.out; .venv/bin/python bench/check_results.py --from bench.out`.
bench: native $(INSTALLED)
	$(BIN)/python bench/interposer_overhead.py
	$(BIN)/python bench/cluster_startup.py
	$(BIN)/python bench/sidecar_cpu.py
	$(BIN)/python bench/operator_cpu.py
	$(BIN)/python bench/analysis_scale.py

# The fuzzing of tests/fuzz run longer with fresh randomness (`make test` runs it bounded, a fixed seed,
# ~15 s): 20,000 inputs per parser, some minutes; FUZZ_EXAMPLES=N to change.
FUZZ_EXAMPLES ?= 20000
bench-fuzz: native $(INSTALLED)
	$(BIN)/python bench/fuzz_parsers.py --examples $(FUZZ_EXAMPLES)

# The image's root filesystem built from the Dockerfile without a Docker engine (Debian bookworm via
# mmdebstrap standing in for the Python base image, each stage in a chroot) and checked: rankwatch
# --help as uid 65532, the C tokeniser, the tracing library, no compiler, no development tools.
# Needs root; 4-6 minutes (the base is cached in ~/.cache/rankwatch/image), so not part of `make test`,
# whose tests/unit/test_dockerfile.py runs the same steps on the host in a temporary tree instead.
image-rootfs: $(INSTALLED)
	$(BIN)/python bench/image_rootfs.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache analysis/*.so
	$(MAKE) -s -C nccl_patch clean
