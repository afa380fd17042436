PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv test demo bench clean

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

test: venv
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests zero1_jax --doctest-modules

DEMO_STEPS ?= 300

demo: venv
	$(BIN)/zero1-train --num_devices 4 \
	  --deepspeed experiments/configs/ds_zero_stage1.json \
	  --model_name_or_path bert-tiny --per_device_train_batch_size 8 \
	  --max_steps $(DEMO_STEPS) --output_dir ./output --overwrite_output_dir

bench: venv
	$(BIN)/python -m experiments.bench --out experiments/results

clean:
	rm -rf $(VENV) output

.PHONY: mutate
# Plant known bugs one at a time and show the tests catch each (experiments/mutate.py).
mutate: venv
	$(BIN)/python -m experiments.mutate
