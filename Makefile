# Every target creates .venv on first use; only Python 3.11 is needed on the machine.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast venv clean

$(STAMP): setup.py pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or make PYTHON=/path/to/python3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) examples/gpt_train.py --method shard --steps 20

# Two worker processes (pytest-xdist): most of a test's time is one XLA compile, on one core. A worker ended
# by a test's timeout (pytest.ini) is not replaced: under --dist loadgroup a replacement leaves the run
# waiting forever; without one the run ends, failed, naming the test.
TEST_WORKERS ?= 2
PYTEST_XDIST := -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart 0

test: $(STAMP)
	$(PY) -m pytest tests -q $(PYTEST_XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest tests -q $(PYTEST_XDIST) -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
