# `make demo` and `make test` each bootstrap .venv from a fresh clone, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# pytest-xdist processes of `make test` and `make compile-check` (`make test TEST_WORKERS=0`: in this process).
TEST_WORKERS ?= 2

.PHONY: demo attention-demo test bench reproduce compile-check gpu-check device-wheels clean

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

# jax's persistent compilation cache, which the pytest-xdist workers and the command lines the tests start inherit:
# a computation one test compiled is read back by the next, and by the next run (entries are keyed by the program,
# the compile options and jax's version, so a changed test or library compiles afresh). Kept in TEST_CACHE between
# runs and emptied once it outgrows TEST_CACHE_MB; `make test TEST_CACHE=` gives the run a cache of its own, deleted
# afterwards (what a fresh machine gets). Not in `compile-check`: jax cannot read back executables compiled for a
# device this machine does not have. The tests' programs are tiny and compiled once each: XLA's CPU backend skips
# its expensive LLVM passes (JAX_DISABLE_MOST_OPTIMIZATIONS; the same HLO passes run): twelve of the slowest tests
# took 3 min 35 s instead of 4 min 43 s.
TEST_CACHE ?= $(HOME)/.cache/focal_jax/jax_tests
TEST_CACHE_MB ?= 2000
test: $(VENV)/.installed
	cache="$(TEST_CACHE)" && \
	if [ -z "$$cache" ]; then cache=$$(mktemp -d -t focal_jax_tests_jax_cache.XXXXXX); \
	elif [ -d "$$cache" ] && [ $$(du -sm "$$cache" | cut -f1) -gt $(TEST_CACHE_MB) ]; then rm -rf "$$cache"; fi && \
	JAX_COMPILATION_CACHE_DIR=$$cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
		JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 JAX_DISABLE_MOST_OPTIMIZATIONS=1 \
		$(PY) -m pytest -q -n $(TEST_WORKERS) tests --doctest-modules focal_jax/attention focal_jax/nn focal_jax/convert \
		focal_jax/data focal_jax/train focal_jax/eval configs; \
	status=$$?; if [ -z "$(TEST_CACHE)" ]; then rm -rf $$cache; fi; exit $$status

bench: $(VENV)/.installed
	$(PY) -m focal_jax.bench attention
	$(PY) -m focal_jax.bench train

# The small-scale reproductions of REPRODUCTION.md (about 40 minutes on 2 CPU cores; finished runs are reused).
reproduce: $(VENV)/.installed
	$(PY) -m focal_jax.eval.reproduce

# Compiles the kernels for an H200 and for TPUs on this machine, no device needed (tests/test_compile_only.py): a
# second environment, .venv-compile, has the project without extras and adds jaxlib's CUDA plugin and libtpu (of
# jax's version), ptxas and cuDNN. tests/test_packaging.py runs there too: every module imports without the extras.
# `python -m focal_jax.bench compile` run there prints the kernels' registers, spills, shared memory and memory.
# In 2 processes (each loads libtpu; `--dist loadgroup` keeps the tests that read the same program compiled at 4K
# tokens in one of them): 4 to 5 minutes on 2 CPU cores.
VENV_COMPILE := .venv-compile
$(VENV_COMPILE)/.installed: setup.py
	$(PYTHON) -m venv $(VENV_COMPILE)
	$(VENV_COMPILE)/bin/python -m pip install -q --upgrade pip
	$(VENV_COMPILE)/bin/python -m pip install -q -e . "pytest>=8" "pytest-xdist>=3.5"
	version=$$($(VENV_COMPILE)/bin/python -c 'import jax; print(jax.__version__)') && \
		$(VENV_COMPILE)/bin/python -m pip install -q nvidia-cuda-nvcc-cu12 "nvidia-cudnn-cu12>=9,<10" \
		"jax-cuda12-plugin==$$version" "jax[tpu]==$$version"
	touch $@

compile-check: $(VENV_COMPILE)/.installed
	JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 $(VENV_COMPILE)/bin/python -m pytest -q -rs -n $(TEST_WORKERS) \
		--dist loadgroup tests/test_compile_only.py tests/test_packaging.py

# On a GPU machine with jax installed and no network (the device machine): install this checkout without its
# dependencies, then the device-only tests and the kernel and training benchmarks (BENCHMARKS.md). What that
# machine's image lacks (grain, ml-collections, array-record, portpicker, tensorboardX; the trainer imports them)
# travels as wheels: `make device-wheels` here fills .whl (Python 3.12, x86-64), which the device run carries. Most
# needed first, each step time-boxed (9.5 minutes in all, inside the device tool's 10 per command) and logged to
# $OUT (the device tool's output folder) as it ends, so that a step that fails or runs out keeps the others' results.
GPU_LOGS = $(if $(OUT),$(OUT),/tmp)
gpu-check: export PYTHONPATH = /tmp/site
gpu-check: export PYTHONUNBUFFERED = 1
gpu-check:
	if [ -d .whl ]; then $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	-timeout 180 $(PYTHON) -m pytest -q -rs tests/test_gpu.py tests/test_kernels.py 2>&1 | tee $(GPU_LOGS)/tests.log
	-timeout 100 $(PYTHON) -m focal_jax.bench kernel --lengths 16384 2>&1 | tee $(GPU_LOGS)/kernel_16k.log
	-timeout 100 $(PYTHON) -m focal_jax.bench kernel --lengths 32768 2>&1 | tee $(GPU_LOGS)/kernel_32k.log
	-timeout 110 $(PYTHON) -m focal_jax.bench train --size 400M --repeats 3 2>&1 | tee $(GPU_LOGS)/train_400m.log
	-timeout 50 $(PYTHON) -m focal_jax.bench kernel --lengths 16384 --launch 64:8:2 64:8:3 64:8:2:64 128:8:2 2>&1 \
		| tee $(GPU_LOGS)/launch_16k.log
	-timeout 30 $(PYTHON) -m focal_jax.bench kernel --lengths 4096 65536 2>&1 | tee $(GPU_LOGS)/kernel_4k_64k.log

device-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl grain ml-collections array-record portpicker tensorboardX

clean:
	rm -rf $(VENV) $(VENV_COMPILE) demo_out
