# Two entry points, each doing its own set-up on a fresh clone:
#   make demo   -- create .venv, install, run the main job
#   make test   -- create .venv, install with test extras, run the test suite
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PYTHON := $(VENV)/bin/python
export JAX_PLATFORMS ?= cpu
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax_cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0.5
export PYTHONUNBUFFERED = 1

.PHONY: venv demo test clean device-wheels clients

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	# Bytecode for the checkout's own modules, written even under PYTHONDONTWRITEBYTECODE (set
	# on this project's machines): without it every process compiles them from source, 0.3 s
	# of each command-line run and of each subprocess a test starts (BENCHMARKS.md "Start-up").
	$(PYTHON) -m compileall -q ik_gat_jax experiments data_prep > /dev/null
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PYTHON) -m experiments.demo $(DEMO_ARGS)

# pytest exits 5 when it collected no test; that is not a failure of the code.
# Two workers (pytest-xdist), each test module on one worker (--dist=loadfile: its module
# fixtures and compiles happen once): most of the suite is single-threaded XLA compiling, so
# two run side by side on a 2-core machine. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: venv
	@if command -v npm > /dev/null; then timeout 300 $(MAKE) -s clients || \
	  echo "make clients failed (no npm registry?): tests/threejs_test.py will skip"; fi
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist=loadfile tests $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

# Real clients of the solver's files for tests/threejs_test.py, pinned by
# tests/clients/package-lock.json: three.js's loaders and the Khronos glTF validator (npm
# packages, pure JavaScript, run by Node.js). `make test` installs them first where npm is on
# PATH; without them those tests skip.
CLIENTS := tests/clients
$(CLIENTS)/node_modules/.installed: $(CLIENTS)/package.json $(CLIENTS)/package-lock.json
	cd $(CLIENTS) && npm ci --no-audit --no-fund --loglevel=error --fetch-retries=1 \
	  --fetch-timeout=30000
	touch $@

clients: $(CLIENTS)/node_modules/.installed

# The prepared GPU check on a machine whose Python already has JAX for CUDA, Flax, optax, orbax
# and PyTorch, and no network (experiments/device_run.sh installs these there): the wheels of
# this package's small pure-Python dependencies such an image may lack (setup.cfg's pins) into
# .whl/ (ignored), and a Flax that imports with jax >= 0.11.1 into .whl/flax/ (flax <= 0.12.9
# does not: nnx imports a name jax 0.11.2 renamed). Python 3.12 wheels, all pure Python.
DEVICE_WHEELS := ml-collections==1.1.0 pygltflib==1.16.5 dataclasses-json==0.6.7 \
	marshmallow==3.26.2 Deprecated==1.3.1 tensorboardX==2.6.5
DEVICE_DOWNLOAD := $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	--implementation cp --platform manylinux2014_x86_64
device-wheels:
	$(DEVICE_DOWNLOAD) -d .whl $(DEVICE_WHEELS)
	$(DEVICE_DOWNLOAD) -d .whl/flax flax==0.12.12

clean:
	rm -rf $(VENV) .jax_cache
