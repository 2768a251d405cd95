#!/usr/bin/env bash
# The oracle crate's really public items (issue 48): rustdoc pages of
# `deltaref`, the `#[doc(hidden)]` ones included. Two runs: stable rustdoc
# (what a reader sees) and nightly with --document-hidden-items (what is
# public but hidden), counted as their union by tools/api_items.py.
# Usage: tools/api_count.sh [--list]
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf target/doc/deltaref target/api-doc/doc/deltaref
cargo doc -q -p deltaref --no-deps
RUSTDOCFLAGS="-Z unstable-options --document-hidden-items" \
  cargo +nightly doc -q -p deltaref --no-deps --target-dir target/api-doc
echo -n "shown: "; python3 tools/api_items.py target/doc/deltaref | sed 's/total //'
python3 tools/api_items.py target/doc/deltaref target/api-doc/doc/deltaref "$@"
