#!/usr/bin/env bash
# Fetch, here, the wheels the device machine lacks into .whl/ (git-ignored), for `bash benchmarks/gpu.sh` there.
# Usage (from the repo root, on a machine that reaches PyPI): bash benchmarks/gpu_wheels.sh
#
# The device image (NVIDIA H200; Python 3.12, torch 2.11, triton 3.6, transformers 5.17; nothing can be fetched
# there) has every q38 dependency but cattrs. What travels must stay under the 64 MiB working-tree limit:
#   cattrs (+ the attrs / typing-extensions versions it needs)  q38's typed config loading: nothing imports without it
#   flash-linear-attention + fla-core 0.6.0                       the FLA GDN path (forward parity, model benchmark)
#   beartype                                                      pytest's shape checks (the project's addopts), for
#                                                                 tests/test_cuda.py
# Left out: triton >= 3.7.1 (the version FLA's gated backward needs on Hopper; a wheel of ~200 MB) and tilelang
# (FLA's other backend; 82 MB with apache-tvm-ffi and z3-solver). Without either, `q38 kernels` there reports FLA's
# backward as not known good and auto trains on the torch GDN; gdn_kernel.py still measures FLA's forward.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf -- .whl
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    cattrs==26.2.1 attrs==26.1.0 typing-extensions==4.16.0 flash-linear-attention==0.6.0 fla-core==0.6.0 \
    beartype==0.23.1
du -sh .whl
ls .whl
