#!/usr/bin/env bash
# Dao-AILab causal-conv1d on the GPU machine (a group of tools/device_batch.sh):
# builds the CUDA extension from the PyPI sdist carried in .whl/
# (causal_conv1d-1.7.0.tar.gz, 30 kB; sha256 3202758494eaa7b5…d32b) with the
# machine's nvcc and torch, for sm_90 only (the sdist builds nine
# architectures otherwise), then runs the conv cases of the conformance
# plan through it and FLA. Cost measured on an H100 call: see
# docs/conformance.md ("How to reproduce").
set -u
src=$(ls .whl/causal_conv1d-*.tar.gz) || exit 1
mkdir -p /tmp/cc1d && tar xzf "$src" -C /tmp/cc1d && cd /tmp/cc1d/causal_conv1d-*/ || exit 1
sed -i 's/^    if FORCE_CXX11_ABI:/    cc_flag = ["-gencode", "arch=compute_90,code=sm_90"]\n    if FORCE_CXX11_ABI:/' setup.py
start=$(date +%s)
CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=16 NVCC_THREADS=4 python3 -m pip install -q --no-build-isolation \
    --no-deps --no-index --target /tmp/site . > $OUT/causal_conv1d_build.log 2>&1
echo "causal-conv1d build: exit $? in $(( $(date +%s) - start )) s" | tee -a $OUT/device.txt
cd - > /dev/null
left=$(( BUDGET - $(date +%s) + start - 30 ))
timeout $left python3 tools/conformance.py --plan tools/conformance_plan.json \
    --deltaref .bin/deltaref --work /tmp/conf --out /tmp/conf/rows-dao.jsonl --families conv \
    --impls ${IMPLS:-causal-conv1d,causal-conv1d-cl,fla-chunk} --budget-s $(( left - 40 )) \
    --keep "${KEEP:-}" --keep-dir $OUT
