#!/usr/bin/env bash
# One GPU-machine call for the conformance run (tools/conformance.py), GDN-2
# against FLA and the fidelity cases: each group a background process (FLA
# autotunes and Triton compiles on the CPU cores in parallel), all within
# $BUDGET seconds. Expects .whl/ (wheels) and .bin/deltaref carried; results
# and logs go to $OUT.
#   bash tools/device_batch.sh GROUP...     (groups: see below; default all)
set -u
export BUDGET=${BUDGET:-500}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton
W=/tmp/conf; mkdir -p $W
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/device.txt
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" >> $OUT/device.txt
conf() { # name families impls [keep patterns]
    timeout $BUDGET python3 tools/conformance.py --plan tools/conformance_plan.json --deltaref .bin/deltaref \
        --work $W --out $W/rows-$1.jsonl --families "$2" --impls "$3" --budget-s $((BUDGET - 60)) \
        --keep "${4:-}" --keep-dir $OUT > $W/log-$1.txt 2>&1
}
python3 -c "import tilelang" >> $OUT/device.txt 2>&1 && echo "tilelang: installed" >> $OUT/device.txt
groups=${*:-kda128 kda64 gdn small}
for g in $groups; do
    case $g in
        kda128) conf kda128 'kda-128' 'flashkda,fla-fused-recurrent,fla-chunk' & ;;
        kda64) conf kda64 'kda-64,kda-k100' 'fla-fused-recurrent,fla-chunk' & ;;
        gdn) conf gdn 'gdn-128' 'opengdn-reference,opengdn-chunkwise,opengdn-triton,fla-fused-recurrent,fla-chunk' & ;;
        small) conf small 'dplr-64,token-shift,conv' 'fla-chunk' & ;;
        flashkda) conf flashkda 'kda-128' 'flashkda' & ;;
        conv) conf conv 'conv' 'fla-chunk' 'conv_silu_bias.fla-chunk' & ;;
        gdnfwd) conf gdnfwd 'gdn-128' 'opengdn-reference,opengdn-chunkwise,opengdn-triton,fla-chunk-fwd' & ;;
        k100) conf k100 'kda-k100' 'fla-fused-recurrent,fla-chunk' & ;;
        gdn2) conf gdn2 'gdn2-64' 'fla-chunk-gdn2' & ;;
        named) # the committed named-regression fixtures, one process each (each shape autotunes)
            for f in $(python3 -c "import json; print(' '.join(c['family'] for c in \
                    json.load(open('tools/conformance_plan.json'))['cases'] if c['family'].startswith('named-')))"); do
                conf "$f" "$f" 'fla-chunk,fla-chunk-gdn2,fla-fused-recurrent,fla-chunk-fwd' &
            done ;;
        fid128|fid64|fiddplr)
            names=$(python3 -c "import sys; sys.path.insert(0, 'tools'); import fla_fidelity as f; \
                print(','.join(n for n, a in f.BAND_CASES if {'fid128': 'k128', 'fid64': 'k64', 'fiddplr': 'dplr'}['$g'] in n \
                and ('dplr' not in n or '$g' == 'fiddplr')))")
            timeout $BUDGET python3 tools/fla_fidelity.py --bin .bin/deltaref --dir $W/$g --json $OUT/band-$g.json \
                --set band --only "$names" > $W/log-$g.txt 2>&1 & ;;
        fid:*) # one fidelity case (either set) in its own process
            timeout $BUDGET python3 tools/fla_fidelity.py --bin .bin/deltaref --dir $W/${g#fid:} --json $OUT/fid-${g#fid:}.json \
                --set all --only "${g#fid:}" > $W/log-${g#fid:}.txt 2>&1 & ;;
        *) [ -f "tools/device_$g.sh" ] && timeout $BUDGET bash tools/device_$g.sh > $W/log-$g.txt 2>&1 & ;;
    esac
done
wait
cat $W/rows-*.jsonl > $OUT/conformance.jsonl 2>/dev/null
# one file for the single-case fidelity groups (few files come back)
ls $OUT/fid-*.json > /dev/null 2>&1 && python3 -c "import json, sys; \
    json.dump({'cases': [c for f in sys.argv[1:] for c in json.load(open(f))['cases']]}, open('$OUT/fidelity.json', 'w'), indent=1)" \
    $OUT/fid-*.json && rm $OUT/fid-*.json
tail -n 40 $W/log-*.txt
tar czf $OUT/logs.tgz -C $W $(cd $W && ls log-* 2>/dev/null) 2>/dev/null
