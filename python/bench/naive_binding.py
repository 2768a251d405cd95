"""Binding overhead: KDA naive forward+backward from Python, to compare with
the Rust bench on the same inputs (`cargo bench -p deltaref-verify --bench naive`).

    python3 python/bench/naive_binding.py

Same problem as the Rust bench: B=1 T=1024 H=HV=4 K=V=64, f64, initial
state, `dht` (gen's inputs for seed 0). Prints the best of 5 for the one call
that gives every output and gradient, and for the forward-only call.
"""

import time

import deltaref


def best_of(n, f):
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    c = deltaref.gen("kda", shape=[1, 1024, 4, 4, 64, 64], seed=0, initial_state=True)
    t = c.tensors
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    both = best_of(5, lambda: deltaref.naive_recurrent_kda_backward(
        *args, t["do"], t["dht"], initial_state=t["initial_state"]))
    fwd = best_of(5, lambda: deltaref.naive_recurrent_kda(
        *args, initial_state=t["initial_state"], output_final_state=True))
    print("python: kda naive, f64, B=1 T=1024 H=4 K=V=64")
    print(f"  naive_recurrent_kda_backward (forward+backward, all gradients): {both:.4f} s")
    print(f"  naive_recurrent_kda (o, final_state):                            {fwd:.4f} s")


if __name__ == "__main__":
    main()
