# Two commands on a fresh machine: `make demo` and `make test`. Everything else is set up here.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first, pinned: on this project's machines pip finds a local CPU build of 2.13.0, while a
# plain `torch` requirement would pull a multi-GB CUDA build. Elsewhere, point pip at a CPU index
# (PIP_EXTRA_INDEX_URL) or override TORCH; pyproject.toml itself only asks for torch>=2.1.
TORCH  ?= torch==2.13.0

.PHONY: setup demo-setup demo test test-cluster docs wheel-smoke soak lint bench bench-ray gpu-check coverage browser valgrind clean

# Two sets, each with its stamp: `make demo` installs what the demo needs (the extras transformers,
# diffusers and server: pyproject.toml says what each brings), `make test` the development set on top
# (so `make test` after `make demo` upgrades the same venv).
setup: $(VENV)/.stamp-dev
demo-setup: $(VENV)/.stamp-demo

$(VENV)/.stamp-venv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	touch $@

$(VENV)/.stamp-demo: pyproject.toml $(VENV)/.stamp-venv
	$(BIN)/python -m pip install -q -e ".[transformers,diffusers,server]"
	touch $@

$(VENV)/.stamp-dev: pyproject.toml $(VENV)/.stamp-venv
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: demo-setup
	HF_HUB_OFFLINE=1 $(BIN)/stopcock demo

test: setup browser valgrind docs wheel-smoke
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m cluster tests/test_ray_cluster.py
	$(BIN)/ruff check stopcock tests bench tiny examples docs/_hooks _stopcock_launch.py
	$(BIN)/mypy

# The Ray engine on a Ray cluster of three nodes on this machine: a replica killed, a node removed,
# the registry restarted (tests/test_ray_cluster.py). A pytest process of its own (a test session
# holds one Ray cluster), so marked `cluster` and left out of the plain pytest run; make test runs it.
test-cluster: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m cluster tests/test_ray_cluster.py

# The documentation site, built strictly (any warning fails) and offline: the CLI and HTTP API pages
# are generated from the code as it builds (docs/_hooks/generated.py). The site lands in site/.
docs: setup
	HF_HUB_OFFLINE=1 NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The release as a user gets it: build the sdist and, from it, the wheel; check their metadata; then
# install the wheel into a fresh venv (torch first, $(TORCH)) and run the demo, the commands and the
# server from a temporary folder, not from the checkout (tests/wheel_smoke.py says what it checks).
wheel-smoke: setup
	rm -rf dist
	$(BIN)/python -m build -q --outdir dist .
	$(BIN)/twine check --strict dist/*
	TORCH="$(TORCH)" $(BIN)/python tests/wheel_smoke.py dist

# The reliability suite's longer versions (tests/test_reliability_*.py); prints the figures measured.
soak: setup
	HF_HUB_OFFLINE=1 STOPCOCK_SOAK=1 $(BIN)/python -m pytest -q tests/test_reliability_*.py

lint: setup
	$(BIN)/ruff check stopcock tests bench tiny examples docs/_hooks _stopcock_launch.py
	$(BIN)/ruff format --check stopcock tests bench tiny examples docs/_hooks _stopcock_launch.py || true
	$(BIN)/mypy

bench: setup valgrind
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench
	$(MAKE) bench-ray

# The Ray Serve engine against LocalEngine, each on a local Ray cluster of its own (a few minutes):
# stop acknowledgements (bench/RESULTS-ray.md) and batched text jobs (bench/RESULTS-ray-batch.md).
bench-ray: setup
	HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled $(BIN)/python -m bench.ray_stop --out bench/RESULTS-ray.md
	HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled $(BIN)/python -m bench.ray_batch --out bench/RESULTS-ray-batch.md

# On one GPU, in under 8 minutes: overhead ratios in float16 and bfloat16 on real-size random-weight
# models (a 0.5B causal LM, an SD-1.5-sized UNet), syncs added per step, abort latency until the GPU
# is idle, batched server throughput; writes bench/RESULTS-gpu.md. Without CUDA it says so and exits 0.
gpu-check: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.gpu_check

# Stop coverage (not part of `make test`): every generating transformers task on a tiny model, and,
# with DIFFUSERS_TESTS (the tests folder of a diffusers checkout), every pipeline diffusers' own test
# fixtures build offline; diffusers' test modules also import parameterized and requests-mock (and
# its Wan-family pipelines clean prompts with ftfy).
coverage: setup
	$(if $(DIFFUSERS_TESTS),$(BIN)/python -m pip install -q parameterized requests-mock ftfy)
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.coverage $(if $(DIFFUSERS_TESTS),--diffusers-tests $(DIFFUSERS_TESTS)) $(COVERAGE_ARGS)

# Headless Chromium for the web page's end-to-end test (Debian's package; Playwright's own
# browser download does not work offline).
# Without root it only warns: the browser test is then skipped (and fails under CI=true).
browser:
	@command -v chromium >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else echo "make browser: chromium is missing; as root: apt-get install chromium" >&2; fi

# valgrind (Debian's package, with the header valgrind/callgrind.h) and a C compiler: the overhead
# benchmark counts each call's instructions under callgrind. Without root it only warns: the bench
# then says the counts are missing, and their test in make test is skipped.
valgrind:
	@command -v valgrind >/dev/null 2>&1 && command -v cc >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq valgrind gcc >/dev/null; \
	  else echo "make valgrind: valgrind or cc is missing; as root: apt-get install valgrind gcc" >&2; fi

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .mypy_cache .ruff_cache
