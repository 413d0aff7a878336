# The verbs a person types. Each creates the virtual environment first if needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Stage commands in dvc.yaml call `python`: put the venv first on PATH for them.
export PATH := $(abspath $(BIN)):$(PATH)
FASHION_DIR := /usr/share/datasets/fashion-mnist

.PHONY: help venv data run repro test lint format ui clean

help:
	@echo "make run    - create .venv, get the data, run the whole pipeline (dvc repro)"
	@echo "make test   - create .venv, run the whole test suite"
	@echo "make ui     - MLflow UI on the embedded store, http://127.0.0.1:5000"
	@echo "make lint   - ruff check + format check"

venv: $(VENV)/.installed

# Reinstall when the dependency list changes. pip (not uv/poetry): it honours local wheels.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# Debian's dataset-fashion-mnist, when it can be installed here (root with apt-get);
# otherwise the fetch stage downloads from the upstream mirrors in params.yaml.
data:
	@if [ ! -f $(FASHION_DIR)/train-images-idx3-ubyte.gz ] && [ "$$(id -u)" = 0 ] \
	    && command -v apt-get >/dev/null; then \
	  echo "installing dataset-fashion-mnist with apt-get"; \
	  apt-get install -y -q dataset-fashion-mnist >/dev/null \
	    || { apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; } \
	    || echo "apt-get failed; the fetch stage will try the download mirrors"; \
	fi

run: venv data
	$(BIN)/dvc repro

repro: venv
	$(BIN)/dvc repro

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

ui: venv
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf data models reports mlruns mlflow.db .dvc/cache .dvc/tmp
