#!/usr/bin/env bash
# The conformance run's fuzzing budget (a group of tools/device_batch.sh):
# `deltaref fuzz` through each GPU runner (tools/runners/worker.py, one
# persistent process per (implementation, op), so kernels compile and
# autotune once), with the head sizes pinned (--fix) where the op has heads.
# bf16 delta rules are judged in the fla-bf16 noise band; token-shift and
# conv run in f32 against 1e-4 (FLA's 1e-3 bar is for its bf16 tests).
# Each run's report and shrunk failures go to $OUT/fuzz.tgz.
#   bash tools/device_fuzz.sh [SECONDS [IMPL:OP ...]]   (default: $BUDGET - 150 s, every run below)
set -u
secs=${1:-$(( ${BUDGET:-400} - 150 ))}; shift $(( $# > 0 ? 1 : 0 ))
runs=${*:-fla-chunk-fwd:kda fla-chunk-fwd:gdn fla-chunk-fwd:dplr fla-chunk-gdn2:gdn2 fla-fused-recurrent:kda \
    fla-fused-recurrent:gdn opengdn-reference:gdn opengdn-triton:gdn fla-chunk:token_shift fla-chunk:causal_conv1d}
W=/tmp/fuzz; mkdir -p $W
for run in $runs; do
    impl=${run%%:*}; op=${run#*:}
    case $impl:$op in
        opengdn-*) # its runner maps FLA's layout: FLA's cases, drawn within what opengdn takes
            judge=(--dtype f32 --tolerance 1e-4 --fix 2,64,64 --within opengdn) ;;
        fla-fused-recurrent:*) # no CP path: draw no cut points
            judge=(--dtype bf16 --band fla-bf16 --samples 4 --fix 2,64,64 --no-cp) ;;
        *:kda|*:gdn|*:dplr|*:gdn2) judge=(--dtype bf16 --band fla-bf16 --samples 4 --fix 2,64,64) ;;
        *) judge=(--dtype f32 --tolerance 1e-4) ;;
    esac
    timeout $((secs + 60)) .bin/deltaref fuzz -q --op $op --worker "python3 -m tools.runners.worker $impl" \
        "${judge[@]}" --max-tokens 300 --time ${secs}s --keep-going --out $W/$impl-$op > $W/$impl-$op.txt 2>&1 &
done
wait
for f in $W/*.txt; do echo "== $(basename $f .txt)"; head -n 30 $f; done
tar czf $OUT/fuzz.tgz -C $W .
