# kd_ckpt: JAX checkpoints that stay inside a host-RAM budget.
#
#   make test          unit + integration tests (pytest on 2 workers, CPU-bound,
#                      so more workers do not help): 9.9 min of tests on 2
#                      cores at 853b67b from a fresh clone (12.6 min with the
#                      venv), 11.8 min (14.8) at 3c3090e and 12.0 (15.2) at
#                      f0f60f6 on a day every bench
#                      ran ~20% slower; 21.7 min at cc3508d and 20.1 min at
#                      9506c6a on a slower one, run one after the other
#   make sweep-restores  restores over untuned shapes x budgets; none may stall
#   make fuzz-budget     saves and restores of drawn states, each measured: the budget must hold
#                      (SEEDS=0-99; FUZZ_ARGS='--processes 2' or '--gcs')
#   make test-fast     without the slow/integration tests
#   make test-orbax-lowest   test-fast against the lowest supported
#                      orbax-checkpoint (ORBAX_LOWEST=0.12.7), venv untouched
#   make demo          stock Orbax vs kd_ckpt peaks side by side (plot), then a
#                      tiny Gemma LoRA through kauldron.main: load pretrained
#                      weights within the budget, train (reusing the frozen
#                      weights), resume, inspect and verify each save
#   make plan          preflight of the full Gemma 3 4B LoRA config's saves
#                      (PLAN_ARGS='--host-ram-budget=16GiB --json' to change)
#   make bench         bench/run.py: GB-scale rows (4 GB leaf, 2.2 GB Gemma-like),
#                      128 MiB grid, 50-save soaks, 2 processes, reuse; ~10 min
#                      on 2 cores; exits 1 if kd_ckpt misses a target
#   make bench-full    bench/run.py --full: the same with the grid at 512 MiB
#   make bench-restore-stock   a checkpoint stock Orbax wrote (one zstd chunk
#                      per shard), restored by Orbax and by kd_ckpt at
#                      64-256 MiB: seconds and peaks; ~1 min
#   make bench-speed   bench/speed.py: ratios to Orbax (and dd) measured in one
#                      run: a training loop's stall in save(), s/GB from 128 MiB
#                      to 4 GiB, per-leaf cost at 10-10,000 leaves; ~8-10 min
#   make bench-shapes  bench/shapes.py: save and restore x Orbax on the test
#                      suite's untuned states (tests/states.py); ~8 min
#   make test-orbax-peer ORBAX_SRC=DIR   Orbax's own handler test suites, with
#                      stock Orbax and with kd_ckpt plugged in (each strategy)
#   make test-kauldron-peer KAULDRON_SRC=DIR   Kauldron's checkpointer suite, with
#                      stock Kauldron and SafeCheckpointer (each strategy)
#   make test-peers KAULDRON_SRC=DIR ORBAX_SRC=DIR   both
#   make bench-gcs     the Gemma-like state saved/restored on a local GCS server
#   make constraints   re-pin constraints.txt from the current .venv
#
# The first target run creates .venv with a Python >= 3.12 found by
# tools/find_python.sh (set KD_PYTHON=/path/to/python3.12 to choose) and
# installs kd_ckpt with the exact tested package set (constraints.txt).

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

VENV ?= .venv
PY := $(VENV)/bin/python
# Re-installs when the dependencies or their pins change.
STAMP := $(VENV)/.installed

# Fake CPU devices for the demo: the tiny config's batch of 8 divides 8, and
# the saves then go through the multi-device (replicated) path.
DEMO_DEVICES ?= 8
DEMO_CFG := configs/gemma_lora.py
PLAN_ARGS ?=

.PHONY: sweep-restores fuzz-budget test test-fast test-orbax-lowest test-orbax-peer test-kauldron-peer test-peers bench-gcs demo bench bench-full calibrate bench-restore-stock bench-speed bench-shapes plan constraints venv clean

venv: $(STAMP)

$(PY):
	@py="$$(tools/find_python.sh)"; \
	echo "Creating $(VENV) with $$py ($$("$$py" --version))"; \
	"$$py" -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[kauldron,gemma,test]"
	@touch $@

# Two workers (the CI machine has 2 cores); each test file runs whole on one
# worker, so module fixtures (GCS server, multi-process saves) are built once.
# Memory budgets are measured per process, so they do not see each other.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not integration" tests

# The core tests (test-fast's) against the lowest orbax-checkpoint kd_ckpt
# supports (kd_ckpt/compat.py SUPPORTED_ORBAX), installed on its own into
# build/ and put ahead of .venv's on PYTHONPATH: the venv is not touched.
ORBAX_LOWEST ?= 0.12.7
test-orbax-lowest: $(STAMP)
	$(PY) -m pip install --quiet --no-deps --upgrade --target build/orbax-$(ORBAX_LOWEST) \
	  "orbax-checkpoint==$(ORBAX_LOWEST)"
	PYTHONPATH=build/orbax-$(ORBAX_LOWEST) $(PY) -c 'import orbax.checkpoint as o, \
	  importlib.metadata as m; assert "build/orbax-" in o.__file__, o.__file__; \
	  print("orbax-checkpoint from", o.__file__)'
	PYTHONPATH=build/orbax-$(ORBAX_LOWEST) $(PY) -m pytest -q \
	  -m "not slow and not integration" tests

# Orbax's own handler test suites (standard_/pytree_checkpoint_handler_test.py)
# with stock Orbax, then with kd_ckpt's streaming and orbax strategies plugged
# in (tools/orbax_peer.py); fails listing every test that passes with stock
# Orbax but not with kd_ckpt.  Nothing is fetched or vendored: ORBAX_SRC is a
# google/orbax checkout, or what tools/fetch_orbax_tests.sh extracts of one.
# ~2 min per mode on 2 cores; per-test outcomes in build/orbax_peer.*.json.
ORBAX_SRC ?=
ORBAX_PEER_ARGS ?=

test-orbax-peer: $(STAMP)
	@if [[ -z "$(ORBAX_SRC)" ]]; then \
	  echo "error: set ORBAX_SRC to a google/orbax checkout; to extract the" \
	    "files needed from a git copy of google/orbax:" >&2; \
	  echo "  tools/fetch_orbax_tests.sh /tmp/orbax_src &&" \
	    "make test-orbax-peer ORBAX_SRC=/tmp/orbax_src" >&2; \
	  exit 2; \
	fi
	@mkdir -p build
	$(PY) tools/orbax_peer.py --orbax-src="$(ORBAX_SRC)" --mode=all \
	  --json=build/orbax_peer.json --log-dir=build/orbax_peer_logs \
	  $(ORBAX_PEER_ARGS)

# Kauldron's own checkpointer suite (kauldron/checkpoints/checkpointer_test.py)
# with stock Kauldron, then with SafeCheckpointer for each strategy
# (tools/kauldron_peer.py); KAULDRON_SRC is a google-research/kauldron
# checkout or what tools/fetch_kauldron_tests.sh extracts of one.
KAULDRON_SRC ?=

test-kauldron-peer: $(STAMP)
	@if [[ -z "$(KAULDRON_SRC)" ]]; then \
	  echo "error: set KAULDRON_SRC; to extract the suite from a git copy of" \
	    "google-research/kauldron: tools/fetch_kauldron_tests.sh /tmp/kauldron_src" >&2; \
	  exit 2; \
	fi
	@mkdir -p build
	$(PY) tools/kauldron_peer.py --kauldron-src="$(KAULDRON_SRC)" --json=build/kauldron_peer.json

# Both peer suites: make test-peers KAULDRON_SRC=... ORBAX_SRC=...
test-peers: test-kauldron-peer test-orbax-peer

# Restores of 7 untuned shapes x 2 writers x 2 placement paths x 17 budgets:
# none may stall, differ, or fail at a budget above one that worked (~2 min).
sweep-restores: $(STAMP)
	$(PY) tools/sweep_restores.py

fuzz-budget: $(STAMP)
	$(PY) tools/fuzz_budget.py --seeds $${SEEDS:-0-99} $${FUZZ_ARGS:-}

bench: $(STAMP)
	$(PY) bench/run.py

# Issue 18's object-storage part: the Gemma-like state on a local GCS server.
bench-gcs: $(STAMP)
	$(PY) bench/gcs.py --out bench/results/gcs.md

bench-full: $(STAMP)
	$(PY) bench/run.py --full

# Re-measures the fixed costs behind kd_ckpt/cost.py (~30 s).
calibrate: $(STAMP)
	$(PY) bench/calibrate.py

bench-restore-stock: $(STAMP)
	$(PY) bench/restore_stock.py --out bench/results/restore_stock.md

# Issue 20: speed as ratios to Orbax and dd measured in the same run (the
# disk's speed varies up to 10x between runs).
bench-speed: $(STAMP)
	$(PY) bench/speed.py --out bench/results/speed.md

# Save and restore against Orbax on the test suite's states (prime dims,
# replicated, 2-D meshes, 2,000 small leaves...), ~8 min.
bench-shapes: $(STAMP)
	$(PY) bench/shapes.py --out bench/results/shapes.md

plan: $(STAMP)
	$(PY) -m kd_ckpt plan --cfg=$(DEMO_CFG) $(PLAN_ARGS)

# Tiny Gemma LoRA (offline, CPU): 4 steps with a save every 2 (ckpt_0/2/4),
# then a second run to step 8 that resumes from ckpt_4.  The full logs stay in
# the workdir; only kd_ckpt's lines and the restore are shown.
demo: $(STAMP)
	@wd="$${DEMO_WORKDIR:-$$(mktemp -d -t kd_ckpt_demo.XXXXXX)}"; mkdir -p "$$wd"; \
	echo "== 1/4 the point: one 512 MiB state saved by stock Orbax and by kd_ckpt (8 CPU devices)"; \
	$(PY) examples/peak_demo.py --out "$$wd"; \
	export XLA_FLAGS="--xla_force_host_platform_device_count=$(DEMO_DEVICES) $${XLA_FLAGS:-}"; \
	run() { \
	  local log="$$1"; shift; \
	  if ! $(PY) -m kauldron.main --cfg=$(DEMO_CFG) --cfg.workdir="$$wd" \
	      --cfg.__args__.tiny=True "$$@" >"$$log" 2>&1; then \
	    tail -n 30 "$$log" | cut -c1-400; echo "FAILED, full log: $$log"; exit 1; \
	  fi; \
	  grep -E "\] (kd_ckpt (step [0-9]+( saved|: writing)|init: )|Starting training loop)" "$$log" \
	    | sed -E 's/^.*[IWE][0-9]{4} [0-9:.]+ +[0-9]+ [^]]+\] //' || true; \
	}; \
	echo; echo "== 2/4 tiny Gemma LoRA, 4 steps, from pretrained weights (stock Orbax, Gemma's" \
	  "published layout) loaded inside the budget; kd_ckpt.SafeCheckpointer with reuse_unchanged:" \
	  "from the second save on, only the LoRA weights and their optimizer state are written"; \
	$(PY) examples/gemma_weights.py "$$wd/pretrained" >"$$wd/pretrained.log" 2>&1 \
	  || { tail -n 20 "$$wd/pretrained.log"; exit 1; }; \
	run "$$wd/train_1.log" --cfg.__args__.pretrained="$$wd/pretrained"; \
	echo; echo "== 3/4 run again to step 8: resumes from the last checkpoint (a bounded restore)"; \
	run "$$wd/train_2.log" --cfg.__args__.pretrained="$$wd/pretrained" --cfg.num_train_steps=8; \
	echo; echo "== 4/4 the checkpoints (python -m kd_ckpt inspect DIR, then verify DIR: CRC32C of every leaf)"; \
	for d in $$(ls -d "$$wd"/checkpoints/ckpt_* | sort -V); do \
	  echo; $(PY) -m kd_ckpt inspect "$$d" | sed -n '/^$$/q;p'; \
	  $(PY) -m kd_ckpt verify "$$d" 2>/dev/null | sed -n 1p; \
	done; \
	echo; echo "Workdir (logs, checkpoints, peak_demo.png): $$wd"

constraints: $(STAMP)
	@{ sed -n '/^#/p' constraints.txt; \
	  $(PY) -m pip freeze --exclude-editable \
	    | grep -v -i -E '^kd[-_]ckpt([=@ ]|$$)'; } > constraints.txt.new
	@mv constraints.txt.new constraints.txt
	@touch $(STAMP)
	@echo "constraints.txt: $$(grep -c '==' constraints.txt) pins"

clean:
	rm -rf .pytest_cache build *.egg-info
