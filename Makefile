# Set-up and entry points. `make demo` and `make test` work on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# DeepSpeed JIT-builds its CPU comm op here: once per environment, not per launch.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
# torch first and pinned: an unpinned torch drags in gigabytes of CUDA wheels.
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
# Test processes (pytest-xdist), whole files per worker so a module's shared training runs happen once.
# Most tests run one thread (tests/conftest.py), so 2 workers use both cores of the CI machine.
TEST_WORKERS ?= 2

.PHONY: install demo test gpu-check gpu-suite offline-wheels system-deps clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[dev]'
	$(PY) -c 'from megaroute.kernels import cpu; cpu.main()'  # JIT-builds the fused CPU kernels once (~30 s)
	# DeepSpeed's CPU comm op (~25 s), built now rather than by the first CPU launch (a demo run or a test).
	DS_ACCELERATOR=cpu $(PY) -c 'from deepspeed.comm.torch import build_shm_op; build_shm_op()' \
	  || echo "DeepSpeed's CPU comm op did not build now; the first CPU launch will try again"
	touch $@

# Debian packages the test-suite needs (only when run as root; otherwise they must be present).
SYSTEM_PACKAGES := g++ make slurm-wlm munge
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi; \
	fi

demo: install
	$(PY) -m megaroute.demo

test: install system-deps
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests $(PYTEST_ARGS)

# The CUDA smoke suite (tests/cuda + the CUDA tests elsewhere) and the GPU benchmarks, on one GPU.
# Fails, rather than passing with every test skipped, when torch sees no CUDA device: on a GPU
# machine `pip install torch==2.13.0` from PyPI is the CUDA build; a venv copied from a CPU
# machine keeps its CPU build (make clean, then make gpu-check).
# `make gpu-suite PY=python3` runs the same without the install step, on a machine whose Python
# already holds CUDA torch and the dependencies (an offline GPU node). It collects only the files
# holding CUDA tests (GPU_TESTS; tests/cuda/test_harness.py checks the list), so the rest of the
# suite's imports (mlflow, lm-eval, ...) need not be there. A short lease: GPU_PYTEST_ARGS="-v -ra -n 8"
# runs the 22 launcher cases (two DeepSpeed jobs each) side by side. -v names each test as it ends,
# so a run cut short by its lease still says which passed.
GPU_TESTS ?= tests/cuda tests/unit/kernels/test_kernels.py
GPU_PYTEST_ARGS ?= -v -ra
gpu-check: install gpu-suite

gpu-suite:
	@$(PY) -c 'import sys, torch; ok = torch.cuda.is_available(); \
	  print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, " \
	        + (torch.cuda.get_device_name() if ok else "no CUDA device")); \
	  sys.exit(0 if ok else "gpu-check: no CUDA device visible to torch" \
	           + (" (CPU-only build: make clean && make gpu-check)" if torch.version.cuda is None else ""))'
	MEGAROUTE_REQUIRE_CUDA=1 $(PY) -m pytest -m cuda $(GPU_TESTS) $(GPU_PYTEST_ARGS)
	$(PY) -m megaroute.bench.step --device cuda
	$(PY) -m megaroute.kernels.bench --dtype bfloat16 float16 float32

# Wheels, into .whl/, of what an offline GPU node's Python may lack for `make gpu-suite`: DeepSpeed
# (pure Python: its ops build at run time) and its needs that CUDA images rarely hold, at the
# versions this venv has (pydantic_core must match pydantic). There: pip install --no-index --no-deps
# --target DIR .whl/*.whl, then PYTHONPATH=DIR:. PATH=DIR/bin:$$PATH make gpu-suite PY=python3.
OFFLINE_PYTHON ?= 3.12
OFFLINE_WHEELS := deepspeed hjson pydantic pydantic-core annotated-types typing-inspection
offline-wheels: install
	rm -rf .whl && mkdir -p .whl
	pins=$$($(PY) -c 'import sys; from importlib.metadata import version; print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' $(OFFLINE_WHEELS)) && \
	  $(PIP) wheel --quiet --no-deps --no-build-isolation --wheel-dir .whl $$(echo $$pins | tr ' ' '\n' | grep '^deepspeed==') && \
	  $(PIP) download --quiet --no-deps --only-binary=:all: --python-version $(OFFLINE_PYTHON) --implementation cp \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $$(echo $$pins | tr ' ' '\n' | grep -v '^deepspeed==')
	ls .whl

clean:
	rm -rf $(VENV) runs *.egg-info data/prepared
