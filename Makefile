# `make setup` builds .venv from nothing but python3; every other target depends on it.
# VARIANT=cpu|cuda forces the fbgemm build; by default CUDA is chosen when nvidia-smi works.
# TORCHREC=1.9|1.8 picks the stack (default 1.9).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
VARIANT ?= $(shell nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
TORCHREC ?= 1.9
# The pins, one stack a line: torch, fbgemm-gpu[-cpu], torchrec. fbgemm is ABI-bound to one torch
# release (fbgemm_gpu/__init__.py's compatibility table: 1.9 -> 2.14, 1.8 -> 2.13), so the three move
# together. torch 2.14 has no +cpu build on the index: its default build brings CUDA libraries.
STACK_1.9 := 2.14.1 1.9.0 1.9.2
STACK_1.8 := 2.13.0 1.8.0 1.8.0
STACK := $(or $(STACK_$(TORCHREC)),$(error TORCHREC=$(TORCHREC) is not a known stack: use 1.9 or 1.8))
TORCH_PIN := torch==$(word 1,$(STACK))
FBGEMM_cpu := fbgemm-gpu-cpu==$(word 2,$(STACK))
FBGEMM_cuda := fbgemm-gpu==$(word 2,$(STACK))
TORCHREC_PIN := torchrec==$(word 3,$(STACK))
TORCHREC_NEEDS := tensordict torchmetrics==1.0.3 tqdm pyre-extensions numpy
DEV_TOOLS := pytest pytest-timeout pytest-xdist ruff matplotlib setuptools torchdata
STAMP := $(VENV)/.setup-$(VARIANT)-torchrec$(TORCHREC)
PYTEST_ARGS ?=

# The tests that hold on the previous stack too (`make test-1.8`): torchrec's names and parameters,
# parity with torchrec's classes, every class bit for bit against its reference, what torchrec
# changed in 1.9, and the ranks' agreement (uneven data, bad keys, malformed batches, at 2 to 4
# ranks). The 1.9-only cases skip, saying why.
TESTS_1.8 := tests/test_compat.py tests/test_compat_names.py tests/test_torchrec_modules.py \
	tests/test_torchrec_parity.py tests/test_torchrec_methods.py tests/test_equivalence.py tests/test_family.py \
	tests/test_lite_hybrid.py tests/test_eval_variants.py tests/test_backward_opt.py tests/test_stash.py \
	tests/test_pec.py tests/test_staged_stages.py tests/test_user_models.py tests/test_async_inplace_copy.py \
	tests/test_upstream_fixes.py tests/test_ranks.py tests/test_malformed.py tests/test_agreement.py

.PHONY: setup test test-quick test-1.8 lint demo time-fresh-clone demo-faults bench bench-overhead bench-tiered hit-rates bench-sweep bench-big bench-agreement figures timeline clean

setup: $(STAMP)

# The stamp makes a second `make setup` take seconds: pip runs again only when this file or
# pyproject.toml changed, or the variant or the stack is switched.
$(STAMP): Makefile pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH_PIN) $(FBGEMM_$(VARIANT)) $(TORCHREC_NEEDS) $(DEV_TOOLS)
	@# torchrec requires `fbgemm-gpu` by name, which would pull the CUDA build: install it alone.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps $(TORCHREC_PIN)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.setup-*
	@touch $@

# Every test, `slow` ones included (the last to run).
test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# A first signal: the tests not marked `slow` (pyproject.toml says what the mark
# covers). `make test` before a merge: the quick tier is a subset, not a replacement.
test-quick: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# torchrec 1.8.0 / torch 2.13.0 in a venv of its own (.venv-1.8), and TESTS_1.8 on it. CI runs `test`.
test-1.8:
	$(MAKE) setup VENV=.venv-1.8 TORCHREC=1.8
	.venv-1.8/bin/python -m pytest $(TESTS_1.8) $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check pipeline rewrite tiered timeline tests examples benchmarks torchrec_pipeline.py
	$(BIN)/ruff format --check pipeline rewrite tiered timeline tests examples benchmarks torchrec_pipeline.py

# DLRM with the prefetch pipeline on local ranks: one per GPU where there are two or more (NCCL), else
# 2 CPU ranks (gloo), as one line says first (examples/dlrm/devices.py; DEMO_NPROC=1 runs one rank on
# a single GPU, DEMO_DEVICE=cpu|cuda forces the device). Synthetic Criteo-like data, loss/AUC/
# throughput as it trains, then the plain loop on the same config (--compare plain), and the summary
# (also in $(DEMO_OUT)/summary.json): the pipeline's schedule and rewrite report, both step times, and
# a last line saying whether the pipeline was faster, and by how much.
DEMO_OUT ?= out/demo
DEMO_ARGS ?= --steps 300 --log-every 50 --eval-every 100
DEMO_NPROC ?=
DEMO_DEVICE ?= auto

demo: setup
	@layout=$$($(BIN)/python -m examples.dlrm.devices --nproc "$(DEMO_NPROC)" --device $(DEMO_DEVICE)) && set -- $$layout && \
	echo "torchrun --nproc_per_node=$$1 examples/dlrm/train.py --device $$2 ..." && \
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=$$1 examples/dlrm/train.py --device $$2 --pipeline prefetch $(DEMO_ARGS) --compare plain --summary-json $(DEMO_OUT)/summary.json

# The same DLRM on 2 ranks, checkpointed every 50 steps, with rank 1 SIGKILLed after step 120:
# torchrun stops rank 0 and restarts both (--max-restarts=1), they resume from step 100 and finish.
# Then an uninterrupted run of the same steps: the two state digests (every parameter and optimizer
# state) must be equal.
FAULTS_OUT ?= out/demo-faults
FAULTS_ARGS ?= --pipeline prefetch --steps 300 --log-every 50 --no-progress

demo-faults: setup
	rm -rf $(FAULTS_OUT)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 --max-restarts=1 examples/dlrm/train.py $(FAULTS_ARGS) --checkpoint-dir $(FAULTS_OUT)/ckpt --checkpoint-every 50 --inject-kill 1:step:120 --summary-json $(FAULTS_OUT)/killed.json
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 examples/dlrm/train.py $(FAULTS_ARGS) --summary-json $(FAULTS_OUT)/uninterrupted.json > $(FAULTS_OUT)/uninterrupted.txt
	$(BIN)/python -c "import json, sys; a, b = (json.load(open('$(FAULTS_OUT)/' + n + '.json'))['state_digest'] for n in ('killed', 'uninterrupted')); print('state_digest killed and resumed:', a); print('state_digest uninterrupted:     ', b); sys.exit(a != b)"

# Base and prefetch pipelines on DLRM at TIMELINE_NPROC ranks (1: a core free for the prefetch thread)
# with tables on disk, shaped like benchmarks/configs.py's tiered-balanced (the rows' I/O and the
# compute of a step of similar size): 12 tables of 500k rows x 32 on disk behind 25,000 cached rows
# each, cold store, 1 id per feature, 256 samples, MLPs 1024-1024 / 2048-1024 (the example has 26
# tables: the other 14 have 1,000 rows, all cached). Traced with torch.profiler after 110 steps (the
# caches full, each miss evicting a dirty row), Prefetch pinned ahead ($(TIMELINE_PREFETCH_ARGS): its
# watch would start inline and decide after the traced steps, so the trace would show no overlap);
# each trace records how its pipeline ran every traced step, read from the pipeline object, and the
# tables and the PNG say it per run (mode, schedule, steps traced); then the PNG and tables in $(TIMELINE_OUT)
# (timeline.png/.md/.json), and the tables' store ($(TIMELINE_STORE), about 800 MB) is removed.
# docs/timeline.md explains how to read them.
TIMELINE_OUT ?= out/timeline
TIMELINE_STORE ?= /var/tmp/timeline-store
TIMELINE_NPROC ?= 1
TIMELINE_TABLES ?= 500000$(shell printf ",500000%.0s" $$(seq 11))$(shell printf ",1000%.0s" $$(seq 14))
TIMELINE_TRAIN_ARGS ?= --steps 134 --warmup-steps 110 --profile-steps 16 --no-progress --batch-size 256 --embedding-dim 32 --num-embeddings $(TIMELINE_TABLES) --pooling 1 --dense-hidden 1024,1024 --over-hidden 2048,1024 --embedding-store $(TIMELINE_STORE) --cache-rows 25000 --cold-store
TIMELINE_PREFETCH_ARGS ?= --prefetch-ahead true
TIMELINE_ARGS ?= --steps 3 --warmup 2

timeline: setup
	rm -rf $(TIMELINE_OUT)/base $(TIMELINE_OUT)/prefetch $(TIMELINE_STORE)
	mkdir -p $(TIMELINE_STORE)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=$(TIMELINE_NPROC) examples/dlrm/train.py --pipeline base $(TIMELINE_TRAIN_ARGS) --profile $(TIMELINE_OUT)/base
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=$(TIMELINE_NPROC) examples/dlrm/train.py --pipeline prefetch $(TIMELINE_TRAIN_ARGS) $(TIMELINE_PREFETCH_ARGS) --profile $(TIMELINE_OUT)/prefetch
	rm -rf $(TIMELINE_STORE)
	@echo "removed the tables' store $(TIMELINE_STORE)"
	$(BIN)/python -m timeline compare $(TIMELINE_OUT)/base/rank0.json $(TIMELINE_OUT)/prefetch/rank0.json -o $(TIMELINE_OUT) --labels base,prefetch $(TIMELINE_ARGS)

# The benchmarks: `python -m benchmarks <what> --help` for the flags, docs/benchmarks.md for the figures.
# `make bench BENCH_ARGS=` runs over loopback, without root.
BENCH_ARGS ?= --link 1gbit
bench: setup
	$(BIN)/python -m benchmarks run $(BENCH_ARGS)

# Process CPU and wall per step on a tiny model, each loop over the plain one, at 1 and 2 ranks; then
# where our SparseDist's time goes, function by function (cProfile).
OVERHEAD_ARGS ?= --rounds 5 --steps 300
bench-overhead: setup
	$(BIN)/python -m benchmarks overhead --world-size 1 $(OVERHEAD_ARGS)
	$(BIN)/python -m benchmarks overhead --world-size 2 $(OVERHEAD_ARGS)
	$(BIN)/python -m benchmarks overhead --cprofile ours-sparse-dist --steps 300 --top 40

# Tables on disk at 1 and 2 ranks: plain, our SparseDist and Prefetch, and Prefetch's bound. Stores go
# to $(BENCH_STORE_DIR) (local disk, ~1.1 GB at most).
BENCH_STORE_DIR ?= /var/tmp/bench-tiered
BENCH_TIERED_ARGS ?=
bench-tiered: setup
	rm -rf $(BENCH_STORE_DIR)
	mkdir -p $(BENCH_STORE_DIR)
	$(BIN)/python -m benchmarks tiered --store-dir $(BENCH_STORE_DIR) $(BENCH_TIERED_ARGS)

# Hit rate of every cache policy on tiered-skewed's ids against Belady's optimum (offline, no I/O).
hit-rates: setup
	$(BIN)/python -m benchmarks hit-rates --fractions 0.01 0.02 0.05 $(HIT_RATES_ARGS)

# 14 points from network-bound (100 Mbit) to compute-bound (loopback); needs root for the emulated
# links. Writes $(SWEEP_OUT)/sweep.md/.json/.png.
SWEEP_OUT ?= out/sweep
SWEEP_ARGS ?=
bench-sweep: setup
	$(BIN)/python -m benchmarks sweep --json $(SWEEP_OUT)/sweep.json --md $(SWEEP_OUT)/sweep.md --png $(SWEEP_OUT)/sweep.png $(SWEEP_ARGS)

# The price of the ranks' per-batch agreement and checks: our Base and SparseDist with and without
# them (+novote), paired rounds, loopback.
AGREEMENT_ARGS ?= --configs demo input-dist-heavy compute-heavy sweep-lo-tiny sweep-lo-ids100 --steps 50 --warmup 10 --rounds 6 --profile-steps 0
bench-agreement: setup
	$(BIN)/python -m benchmarks run --variants ours-base ours-base+novote ours-sparse-dist@late ours-sparse-dist@late+novote --json out/bench/agreement.json --md out/bench/agreement.md $(AGREEMENT_ARGS)

# Tables of BIG_GB in total on disk, trained with a small cache; fails if peak RSS passes 2 GB.
BIG_GB ?= 16
bench-big: setup
	$(BIN)/python -m benchmarks big-tables --total-gb $(BIG_GB) --store-dir $(BENCH_STORE_DIR)-big $(BIG_ARGS)

# Every figure file in docs/results/ written again by the command its `Command:` line states, one at a
# time (hours); those emulating a link need root and are skipped without
# it. FIGURES_ARGS=--list prints the plan and runs nothing; FIGURES_ARGS="--only vote.md" one file.
FIGURES_ARGS ?=
figures: setup
	$(BIN)/python -m benchmarks figures $(FIGURES_ARGS)

# How long a new user waits: `make setup`, `make demo` and `make test` timed one after the other on a
# fresh clone of HEAD (in a temporary folder; pip's cache as it is), written with the command, the
# machine, the date and the commit to $(FRESH_CLONE_OUT), whose times README.md quotes. Minutes, and
# gigabytes of downloads on a cold cache: run it on a quiet machine.
FRESH_CLONE_OUT ?= docs/results/fresh-clone.json
time-fresh-clone:
	$(PY) scripts/fresh_clone.py --out $(FRESH_CLONE_OUT)

clean:
	rm -rf $(VENV) *.egg-info
