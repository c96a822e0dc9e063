#!/usr/bin/env bash
# `make megatron`: Megatron-DeepSpeed's unmodified pretrain_gpt.py on PACI, on a CPU (README, "Megatron-DeepSpeed").
# The lines below are the README section's commands without its install line (make's megatron target installs the
# megatron-test extra first); tests/megatron/test_readme_megatron.py checks they stay the same. MEGATRON_ITERS
# (default 20) shortens the run; MASTER_PORT (default 29500) when another job holds that port.
set -euo pipefail
cd "$(dirname "$0")/../.."
# --- README commands ---
source .venv/bin/activate
python -m ds_paci.integrations.megatron prepare
export PYTHONPATH=$PWD/launch/megatron_cpu${PYTHONPATH:+:$PYTHONPATH} DS_ACCELERATOR=cpu PYTHONUTF8=1 OMP_NUM_THREADS=1
deepspeed --num_gpus 2 --master_port ${MASTER_PORT:-29500} --module ds_paci.run \
    .cache/megatron/Megatron-DeepSpeed/pretrain_gpt.py \
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 2 --global-batch-size 8 --train-iters ${MEGATRON_ITERS:-20} --lr-warmup-iters 2 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --weight-decay 0.01 --seed 1234 \
    --data-impl mmap --train-data-path .cache/megatron/data/shakespeare-bpe1024-train_text_document \
    --valid-data-path .cache/megatron/data/shakespeare-bpe1024-valid_text_document \
    --tokenizer-type GPT2BPETokenizer --vocab-file .cache/megatron/data/bpe-1024/vocab.json \
    --merge-file .cache/megatron/data/bpe-1024/merges.txt \
    --log-interval 1 --eval-interval 10 --eval-iters 2 --num-workers 0 \
    --pipeline-model-parallel-size 2 --tensor-model-parallel-size 1 --no-gradient-accumulation-fusion \
    --save .cache/megatron/runs/gpt-paci --save-interval 10 \
    --deepspeed --deepspeed_config launch/megatron_cpu/ds_paci.json
