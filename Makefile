PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv test test-slow test-optax test-all test-newest newest-py demo bench clean tolerances docs docs-check dist

# The venv, then jax's CUDA plugin at jax's own version beside it (not in it:
# a plugin in site-packages makes every jax start on a machine without a GPU
# print its failure to load CUDA). tests/conftest.py and experiments/gpu/aot.py
# put it on sys.path to compile steps for GPUs without one
# (zero1_jax.inspect.gpu). ~0.5 GB, no CUDA libraries. A jax release can reach
# the index before its plugin (jax 0.12.1 did): then jax goes back to the
# newest version the plugin has. Bytecode up front: with
# PYTHONDONTWRITEBYTECODE set (as on this project's CI image) nothing caches
# it, and every Python process (the tests start dozens of zero1-train runs)
# recompiled jax & co from source: ~5 s each. pip's messages (setuptools'
# editable-install banner, warnings) go to $(VENV)/pip.log, shown if it fails.
$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	@echo "make venv: pip install -e '.[test,cli,experiments]' into $(VENV) (pip's messages: $(VENV)/pip.log)"
	@{ $(BIN)/pip install -q --upgrade pip && \
	  $(BIN)/pip install -q -e ".[test,cli,experiments]"; } > $(VENV)/pip.log 2>&1 || \
	  { cat $(VENV)/pip.log; exit 1; }
	@echo "make venv: jax's CUDA plugin (compile-only, for GPU programs without a GPU) in $(VENV)/aot-plugins"
	@v="$$($(BIN)/python -c 'import jax; print(jax.__version__)')" && \
	  if ! $(BIN)/pip install -q --no-deps --target $(VENV)/aot-plugins \
	      "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v" 2>/dev/null; then \
	    p="$$($(BIN)/pip index versions jax-cuda12-plugin 2>/dev/null \
	      | sed -n 's/^jax-cuda12-plugin (\(.*\))$$/\1/p')" && \
	    echo "make venv: no CUDA plugin for jax $$v on the index: jax $$p, the newest it has" && \
	    $(BIN)/pip install -q "jax==$$p" "jaxlib==$$p" && \
	    $(BIN)/pip install -q --no-deps --target $(VENV)/aot-plugins \
	      "jax-cuda12-plugin==$$p" "jax-cuda12-pjrt==$$p"; \
	  fi
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
	$(PYTEST) -m "slow and not optax_full" tests

# The rest of optax's own suite through zero1 (tests/test_optax_suite.py):
# optax's side of every case and alias_test's 10,000-step convergence loops.
# Over an hour on 2 cores: not in CI.
test-optax: venv
	$(PYTEST) -m optax_full tests/test_optax_suite.py

# Both, as CI does.
test-all: test test-slow

DEMO_STEPS ?= 300

# The newest Python and jax (pip's latest) on the tests that have broken
# there before: jax 0.12 moved results by an ulp where a tolerance assumed
# bitwise, and CPython 3.12.0-3.12.2 cannot start threads at exit (checkpoint
# saves); and on those that read jaxprs, whose forms change between jax
# versions (0.12's scan takes its operands as a flat tree). .ci/run runs this
# when python3.12 exists. The full suite on them:
# `make test PY=python3.12 VENV=.venv-newest`.
NEWEST_PY ?= $(or $(lastword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12)),python3.12)
NEWEST_TESTS ?= tests/test_checkpoint_lifecycle.py tests/test_step.py \
  tests/test_jit_mode.py tests/test_readme.py tests/test_docs.py tests/test_flax.py \
  tests/test_offload.py tests/test_value_and_grad.py \
  tests/test_gpu_aot.py tests/test_gpu_trainstate.py tests/test_gpu_tools.py tests/test_shard_params.py \
  tests/test_jit_in_shardings.py tests/test_params_free.py tests/test_gpu_hosts.py \
  tests/test_dispatch.py tests/test_gpu_measure.py tests/test_narrow_gathers.py tests/test_gpu_gather_order.py \
  tests/test_gpu_precisions.py tests/test_gpu_accumulation.py tests/test_mesh2d_nnx.py tests/test_inner_state.py \
  tests/test_distributed.py tests/test_cache_guard.py tests/test_fp32_master.py \
  tests/test_rows.py tests/test_dtype_check.py tests/test_value_and_grad_aux.py \
  tests/test_state_reads.py \
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

# The docs site from docs/ into site/: warnings, broken links and anchors are
# errors. Its tools (the docs extra) go into the same venv, on first use only,
# so `make venv` stays as fast as it was. NO_MKDOCS_2_WARNING: Material's
# banner about its end of life (pyproject.toml's docs extra says why it is
# used), printed on every build.
$(BIN)/.docs-installed: $(BIN)/.installed
	$(BIN)/pip install -q -e ".[docs]"
	touch $@

docs: $(BIN)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The built site in headless Chromium (Debian's, .ci/install-chromium.sh):
# overflow, highlighted code, cross-references, no request leaving the
# machine; screenshots of the home, forms and API pages in site/_screenshots/.
docs-check: docs
	$(BIN)/python .ci/docs_check.py --site site

# A release: wheel + sdist into dist/, metadata checked (twine), contents
# checked (.ci/check_dist.py), then the wheel installed into a fresh venv
# and used from outside the repository (no source tree on sys.path).
WHEEL_VENV ?= .venv-wheel
$(BIN)/.release-installed: $(BIN)/.installed
	$(BIN)/pip install -q -e ".[release]"
	touch $@

dist: $(BIN)/.release-installed
	rm -rf dist $(WHEEL_VENV)
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(BIN)/python .ci/check_dist.py dist
	$(PY) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q dist/*.whl
	cd / && $(CURDIR)/$(WHEEL_VENV)/bin/python -c "import zero1_jax, os; \
	  assert 'site-packages' in zero1_jax.__file__, zero1_jax.__file__; \
	  print('installed', zero1_jax.__version__, 'from', os.path.dirname(zero1_jax.__file__))"
	cd / && $(CURDIR)/$(WHEEL_VENV)/bin/zero1-train --help > /dev/null
	cd / && $(CURDIR)/$(WHEEL_VENV)/bin/zero1-export --help > /dev/null
	# and a real run, 2 steps of bert-tiny from a scratch directory
	tmp="$$(mktemp -d)" && cp experiments/configs/ds_zero_stage1.json "$$tmp/ds.json" && \
	  cd "$$tmp" && $(CURDIR)/$(WHEEL_VENV)/bin/zero1-train --num_devices 2 \
	    --deepspeed ds.json --model_name_or_path bert-tiny \
	    --per_device_train_batch_size 16 --max_steps 2 --output_dir out > log.txt 2>&1 \
	  || { tail -20 log.txt; exit 1; }; \
	  test -f "$$tmp/out/summary.json" && echo "dist: the wheel's zero1-train trained 2 steps in $$tmp" && rm -rf "$$tmp"

clean:
	rm -rf $(VENV) .venv-newest $(WHEEL_VENV) output site dist

.PHONY: mutate
# Plant known bugs one at a time and show the tests catch each (experiments/testing/mutate.py).
mutate: venv
	$(BIN)/python -m experiments.testing.mutate

# Numerical tests under other XLA:CPU code (AVX2, AVX, fast-math): the worst
# error each bound saw, into docs/tolerances.md (experiments/testing/tolerance_sweep.py).
tolerances: venv
	$(BIN)/python -m experiments.testing.tolerance_sweep --out docs/tolerances.md
