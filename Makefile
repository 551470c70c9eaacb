# Two set-up commands on a fresh machine: `make demo` and `make test`.
# torch==2.13.0 is installed first and on its own: an unpinned torch pulls a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench-cpu clean

$(STAMP): pyproject.toml integrations/langchain/pyproject.toml integrations/llamaindex/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]" -e "integrations/langchain[test]" -e "integrations/llamaindex[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m dyngen_core fetch-demo-model
	$(PY) examples/langchain_rag.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check dyngen_core integrations tests examples benchmarks
	$(VENV)/bin/mypy dyngen_core

clean:
	rm -rf $(VENV)
