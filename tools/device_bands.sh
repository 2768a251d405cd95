#!/usr/bin/env bash
# The emulated bands of every fidelity case (tools/fla_fidelity.py's sets), on
# the GPU machine's CPU cores beside the FLA runs; starts from the bands
# already committed and writes $OUT/bands-fla-bf16-s8.json.
cp tools/fidelity/bands-fla-bf16-s8.json $OUT/bands-fla-bf16-s8.json
cd tools && exec python3 fla_band_compare.py --bands-only --set all --bin ../.bin/deltaref --samples 8 \
    --bands-json $OUT/bands-fla-bf16-s8.json --jobs 3
