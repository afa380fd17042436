PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv test test-slow test-all test-newest newest-py demo bench clean tolerances

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test,cli,experiments]"
	# Bytecode up front: with PYTHONDONTWRITEBYTECODE set (as on this project's
	# CI image) nothing caches it, and every Python process (the tests start
	# dozens of zero1-train runs) recompiled jax & co from source: ~5 s each.
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib zero1_jax experiments tests
	touch $@

venv: $(BIN)/.installed

PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

# The fast suite: everything but the tests marked slow (multi-process jobs,
# real launchers, kill -9 / Ctrl-C of running jobs, the benchmark's own run).
test: venv
	$(PYTEST) -m "not slow" tests zero1_jax --doctest-modules

# The slow ones; CI runs both (.ci/run).
test-slow: venv
	$(PYTEST) -m slow tests

# Both, as CI does.
test-all: test test-slow

DEMO_STEPS ?= 300

# The newest Python and jax (pip's latest) on the tests that have broken
# there before: jax 0.12 moved results by an ulp where a tolerance assumed
# bitwise, and CPython 3.12.0-3.12.2 cannot start threads at exit (checkpoint
# saves). .ci/run runs this when python3.12 exists. The full suite on them:
# `make test PY=python3.12 VENV=.venv-newest`.
NEWEST_PY ?= $(or $(lastword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12)),python3.12)
NEWEST_TESTS ?= tests/test_checkpoint_lifecycle.py tests/test_step.py \
  tests/test_jit_mode.py tests/test_readme.py tests/test_flax.py \
  tests/test_offload.py tests/test_value_and_grad.py \
  "tests/test_equivalence.py::test_bitwise_when_reduced_gradients_are_bitwise_equal"

newest-py:
	@echo $(NEWEST_PY)

test-newest:
	$(MAKE) venv PY=$(NEWEST_PY) VENV=.venv-newest
	.venv-newest/bin/python -c "import sys, jax; print('newest:', sys.version.split()[0], 'jax', jax.__version__)"
	.venv-newest/bin/python -m pytest -q -n 2 --dist loadfile $(NEWEST_TESTS)

demo: venv
	$(BIN)/zero1-train --num_devices 4 \
	  --deepspeed experiments/configs/ds_zero_stage1.json \
	  --model_name_or_path bert-tiny --per_device_train_batch_size 8 \
	  --max_steps $(DEMO_STEPS) --output_dir ./output --overwrite_output_dir

bench: venv
	$(BIN)/python -m experiments.bench --out experiments/results

clean:
	rm -rf $(VENV) .venv-newest output

.PHONY: mutate
# Plant known bugs one at a time and show the tests catch each (experiments/mutate.py).
mutate: venv
	$(BIN)/python -m experiments.mutate

# Numerical tests under other XLA:CPU code (AVX2, AVX, fast-math): the worst
# error each bound saw, into docs/tolerances.md (experiments/tolerance_sweep.py).
tolerances: venv
	$(BIN)/python -m experiments.tolerance_sweep --out docs/tolerances.md
