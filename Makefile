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

.PHONY: venv demo test clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PYTHON) -m experiments.demo $(DEMO_ARGS)

# pytest exits 5 when it collected no test; that is not a failure of the code.
test: venv
	$(PYTHON) -m pytest -q tests $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) .jax_cache
