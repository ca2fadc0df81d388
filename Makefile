# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel on these machines; GPU users pass e.g. TORCH=torch to keep their own build.
TORCH ?= torch==2.13.0

.PHONY: install test lint demo bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: install
	$(PY) -m cli.demo

bench: install
	$(PY) bench/throughput.py
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
