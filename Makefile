# Distributed PyTorch, Step by Step: the learner's entry point. `make` (or `make help`) lists everything.
#
#   make lesson-01                  set up .venv on first use, then run lesson 01
#   make lesson-05 ARGS="--world-size 3"   pass flags through to the lesson
#   make lesson-05 STEP=1           pause after each step (same as ARGS=--step)
#   make test                       the whole test suite

SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LESSON_FILES := $(sort $(wildcard lessons/[0-9][0-9]_*.py))
LESSON_NUMS := $(foreach f,$(LESSON_FILES),$(shell basename $(f) | cut -c1-2))
STEP_FLAG := $(if $(filter-out 0,$(STEP)),--step)

# Lessons that need a launcher run through it; the rest run under plain python.
RUN_06 := tools/nodes.py --nnodes 2 --nproc-per-node 2 --
RUN_07 := tools/nodes.py --elastic --nnodes 1 --nproc-per-node 2 --max-restarts 3 --

# check-% and lesson-% are pattern rules
.PHONY: checks help venv wheels FORCE lesson-costs lessons test clean distclean docs-output diff bench bench-docs read gpu-check

help:
	@echo "Distributed PyTorch, Step by Step"
	@echo
	@echo "Lessons (make lesson-NN [ARGS=\"--flag value\"] [STEP=1]):"
	@for f in $(LESSON_FILES); do \
		n=$$(basename $$f | cut -c1-2); \
		t=$$(sed -n '1s/^"""Lesson [0-9]*: //p' $$f | sed 's/\.$$//'); \
		printf "  make lesson-%s   %s\n" "$$n" "$$t"; \
	done
	@echo
	@echo "Other targets:"
	@printf "  %-26s %s\n" \
		"make lessons" "run every lesson in order, with its defaults" \
		"make check-NN [FILE=path]" "check an answer to lesson NN's exercise (make checks lists them)" \
		"make diff TO=NN [FROM=NN]" "what lesson NN adds to its parent (or to lesson FROM)" \
		"make read" "the lessons as a website, each step's doc beside its code (runs/read/)" \
		"make test" "run the test suite (pytest, CPU only, about 10-11 minutes on 2 cores)" \
		"make bench" "measured speedups and costs (2-3 minutes on 2 cores; writes runs/bench/)" \
		"make bench-docs" "maintainers: make bench, then rewrite docs/PERFORMANCE.md (en, zh) and its plots" \
		"make lesson-costs" "maintainers: measure every lesson's cost, rewrite docs/TEACHING.md's table (half an hour or more)" \
		"make gpu-check" "on a GPU machine: every lesson's GPU path against the CPU, one table (runs/gpu-check/)" \
		"make docs-output" "rerun the commands whose output the docs show (DOCS=docs/01_*.md)" \
		"make venv [CPU_ONLY=1]" "create .venv and install requirements.txt (done automatically)" \
		"make wheels WHEELS=dir" "a classroom: download every wheel once; each laptop: make venv WHEELS=dir, offline" \
		"make clean" "delete runs/ and caches (keeps .venv)" \
		"make distclean" "clean, and delete .venv too"

# The virtual environment: created on first use, re-installed when requirements.txt changes.
# CPU_ONLY=1 takes torch and torchvision from PyTorch's CPU wheel index instead of PyPI's
# default wheels, which bring about 3 GB of CUDA libraries a laptop without a GPU never uses.
# (Not tested here: our machines reach PyPI only. See README, "Installing for a classroom".)
CPU_INDEX := https://download.pytorch.org/whl/cpu
PIP_INDEX := $(if $(filter-out 0,$(CPU_ONLY)),--extra-index-url $(CPU_INDEX))
# WHEELS=folder: a classroom's offline install. `make wheels WHEELS=folder` downloads every
# wheel requirements.txt needs, once, on one laptop like the others (same OS, CPU and Python);
# `make venv WHEELS=folder` then installs from a copy of that folder only (pip's --no-index
# --find-links): no network, no index. README, "Installing for a classroom".
PIP_FROM := $(if $(WHEELS),--no-index --find-links "$(WHEELS)",$(PIP_INDEX))
# "Changes" means its content: the stamp holds requirements.txt's sha256, written once pip has
# installed it. Not its time: a fresh clone beside an existing .venv (or a git checkout) gives
# requirements.txt a newer time and the same pins, and pip would run again for nothing.
REQ_SUM := $(firstword $(shell (sha256sum requirements.txt || shasum -a 256 requirements.txt) 2>/dev/null))
VENV_CURRENT = $(and $(REQ_SUM),$(filter $(REQ_SUM),$(shell cat $(STAMP) 2>/dev/null)))
$(STAMP): $(if $(VENV_CURRENT),,FORCE)
	$(if $(WHEELS),$(if $(wildcard $(WHEELS)/.),,$(error error: WHEELS=$(WHEELS) is not a folder; make wheels WHEELS=$(WHEELS) fills one on a machine with the network)))
	@echo "Setting up $(VENV) (first run only: $(if $(WHEELS),installs from $(WHEELS) without the network,downloads and installs torch$(COMMA) which is large); pip shows its progress..."
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --disable-pip-version-check --progress-bar on $(PIP_FROM) -r requirements.txt 2> >(grep -v "^WARNING: Location" >&2)
	@echo $(REQ_SUM) > $(STAMP)

venv: $(STAMP)

FORCE:

wheels:  ## a classroom's wheel cache: every wheel requirements.txt needs, into WHEELS=folder
	$(if $(WHEELS),,$(error error: name the folder, e.g. make wheels WHEELS=../wheels; then, on each laptop, make venv WHEELS=../wheels))
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip download --disable-pip-version-check --progress-bar on --only-binary=:all: $(PIP_INDEX) -r requirements.txt -d "$(WHEELS)" 2> >(grep -v "^WARNING: Location" >&2)
	@echo "$(WHEELS) holds every wheel; copy it to each laptop, then there: make venv WHEELS=<that folder>"

COMMA := ,

# lesson-5 is lesson-05, as in make diff FROM=5
PAD = $(if $(filter 0 1 2 3 4 5 6 7 8 9,$(1)),0$(1),$(1))

# $(error ...): one line and exit code 2, without make's own "Error" line after it
lesson-:
	$(error error: name the lesson, e.g. make lesson-01; the lessons are: $(LESSON_NUMS))

lesson-%:
	$(if $(wildcard lessons/$(call PAD,$*)_*.py),,$(error error: there is no lesson '$*'; the lessons are: $(LESSON_NUMS) (e.g. make lesson-01)))
	@f=$$(ls lessons/$(call PAD,$*)_*.py | head -n 1); \
	{ [ -n "$(VENV_CURRENT)" ] || $(MAKE) --no-print-directory $(STAMP); } && \
	LESSON_MAKE_PID=$$PPID exec $(PY) $(RUN_$(call PAD,$*)) $$f $(STEP_FLAG) $(ARGS)

# FILE in single quotes (its own quotes escaped): a path with spaces or quotes is one argument
check-%: $(STAMP)  ## check a learner's exercise: make check-05 [FILE=path]
	@$(PY) tools/check_exercise.py $* '$(subst ','\'',$(FILE))'

checks: $(STAMP)
	@$(PY) tools/check_exercise.py list

lessons: $(STAMP)
	@set -e; for n in $(LESSON_NUMS); do $(MAKE) --no-print-directory lesson-$$n; done

# pytest-xdist workers: one per core, 4 at most. Measured on 2 cores (2026-12-07, /proc/stat
# over the whole suite): with 2 workers the cores are 86-88% busy; a third worker filled them
# (96-98%), but the same tests then took more CPU (1,683 core-seconds, counted by a cgroup
# around each worker, against 1,385-1,505 with two: more processes than cores), so the suite
# took as long or longer (872 s and 912 s against 835-860 s from a fresh clone; 793 s once on
# a warm tree). Each test file runs on one worker, so its fixtures run once, unless it says
# SPREAD_OVER_WORKERS = True (tests/conftest.py).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

clean:
	rm -rf runs .pytest_cache
	find . -name __pycache__ -type d -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)

docs-output: $(STAMP)  ## regenerate the real output pasted into docs/*.md
	$(PY) tools/doc_output.py $(DOCS)

diff: $(STAMP)  ## what a lesson adds to its parent: make diff TO=14 (or FROM=04 TO=05; ARGS=--all)
	@if [ -z "$(TO)" ]; then echo "error: name the lesson, e.g. make diff TO=14 (its parent is found), or make diff FROM=04 TO=05" >&2; exit 2; fi
	@$(PY) tools/lesson_diff.py "$(FROM)" $(TO) $(ARGS)

bench: $(STAMP)  ## measured performance: runs/bench/ (results.json, tables, plots, this machine's PERFORMANCE.md)
	$(PY) -m bench.run $(ARGS)

bench-docs: $(STAMP)  ## rewrite the committed docs/PERFORMANCE.md, docs/zh/PERFORMANCE.md and docs/img/bench/ (needs matplotlib)
	$(PY) -m bench.run --publish $(ARGS)

lesson-costs: $(STAMP)  ## maintainers: measure what each lesson costs and rewrite docs/TEACHING.md's table (en, zh); half an hour or more
	$(PY) tools/lesson_costs.py $(ARGS)

gpu-check: $(STAMP)  ## every lesson's GPU path against the same run on the CPU: runs/gpu-check/table.md (no CUDA: one line, exit 0)
	@$(PY) tools/gpu_check.py $(ARGS)

read: $(STAMP)  ## the reading site: each lesson's doc beside its code, step by step (runs/read/)
	@$(PY) tools/read_site.py
