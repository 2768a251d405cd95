#!/usr/bin/env python3
"""Prints the 2^(k/128) table of `reference/src/exp.rs` (glibc's `__exp_data.tab`,
from ARM's optimized-routines): for k = 0..127, `H[k]` = 2^(k/128) rounded to
the nearest double and `T[k]` = 2^(k/128)/H[k] - 1 rounded, stored as
`bits(T[k]), bits(H[k]) - (k << 45)`. Computed here from first principles
(60-digit decimal arithmetic), so the table is derived, not copied.
Usage: python3 tools/exp_table.py"""
import struct
from decimal import Decimal, getcontext

getcontext().prec = 60
LN2 = Decimal(2).ln()


def bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


words = []
for k in range(128):
    exact = (LN2 * k / 128).exp()
    h = float(exact)  # CPython rounds a Decimal to the nearest double
    t = float(exact / Decimal(h) - 1)
    words += [bits(t), (bits(h) - (k << 45)) % (1 << 64)]
print("const TABLE: [u64; 256] = [")
for i in range(0, 256, 2):
    print(f"    0x{words[i]:016x}, 0x{words[i + 1]:016x},")
print("];")
