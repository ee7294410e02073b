#!/usr/bin/env bash
# Launch the Qwen3.8-2.4T pre-training run (specs/train/qwen3_8_2_4t.yaml) on this node of a multi-node job.
#
# Run it once on every node (e.g. from the scheduler's per-node command), with the same MASTER_ADDR everywhere:
#
#   NNODES=128 NODE_RANK=<0..127> MASTER_ADDR=<host of node 0> scripts/launch_qwen3_8_2_4t.sh [--set KEY=VALUE ...]
#
# The layout qwen3_8_2_4t (fsdp × ep 32 × cp 2) needs a multiple of 64 ranks: 128 nodes × 8 devices = 1024 ranks
# gives fsdp 16. Device and backend are automatic (Ascend NPU + hccl, CUDA + nccl); out_dir must be on a file system
# every node sees (the checkpoint shards of all ranks go into one directory). SIGTERM (e.g. the scheduler's
# pre-emption signal) saves a checkpoint and exits; launching the same command again resumes.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nnodes="${NNODES:?set NNODES, the number of nodes}"
node_rank="${NODE_RANK:?set NODE_RANK, the index of this node, 0 .. NNODES-1}"
master_addr="${MASTER_ADDR:?set MASTER_ADDR, the host name of node 0}"
master_port="${MASTER_PORT:-29500}"
nproc="${NPROC_PER_NODE:-8}"
config="${CONFIG:-${repo}/specs/train/qwen3_8_2_4t.yaml}"

# q38 launch is torchrun (same options) whose SIGTERM saves and exits 0 (docs/operations.md)
exec q38 launch \
  --nnodes "${nnodes}" --node_rank "${node_rank}" --nproc_per_node "${nproc}" \
  --master_addr "${master_addr}" --master_port "${master_port}" \
  train "${config}" "$@"
