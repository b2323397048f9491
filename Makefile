# `make demo` and `make test` each bootstrap .venv from a fresh clone, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo attention-demo test bench clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	rm -rf demo_out/quickstart
	$(PY) -m focal_jax.train --config experiments/quickstart.py --workdir demo_out/quickstart

attention-demo: $(VENV)/.installed
	$(PY) -m focal_jax.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q tests --doctest-modules focal_jax/attention focal_jax/nn focal_jax/convert focal_jax/data focal_jax/train configs

bench: $(VENV)/.installed
	$(PY) -m focal_jax.bench attention

clean:
	rm -rf $(VENV) demo_out
