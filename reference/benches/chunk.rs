//! Chunked vs naive forward+backward, f64, B=1 T=1024 H=4 at K=V=64 and
//! K=V=128 (issue 20: chunk at least as fast as naive), with the GFLOP/s of
//! each ([`deltaref::ops`]'s counts) and its fraction of the measured
//! no-FMA mul+add peak.
//! Run: `cargo bench -p deltaref --bench chunk`.

mod common;

use common::best_of;

use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};
use deltaref::ops::{self, OpCount};

const REPS: usize = 5;

fn main() {
    let (t, h) = (1024, 4);
    println!(
        "forward+backward, f64, B=1 T={t} H={h}, {} rayon threads, best of {REPS}",
        rayon::current_num_threads()
    );
    let peak = ops::peak_gflops(1.0);
    println!("peak (f64 mul+add chains, no FMA): {peak:.1} GFLOP/s");
    for kd in [64, 128] {
        bench(t, h, kd, peak);
    }
}

/// `name  time  GFLOP/s  % of peak` for `ops` operations in `secs`.
fn rate(name: &str, secs: f64, ops: f64, peak: f64) -> String {
    let g = ops / secs / 1e9;
    format!(
        "{name} {:7.2} ms {g:5.1} GFLOP/s {:4.0}%",
        secs * 1e3,
        100.0 * g / peak
    )
}

/// Ops of one forward+backward over `h` heads of `t` tokens.
fn counts(t: usize, h: usize, c: usize, naive: OpCount, chunk: OpCount) -> (f64, f64) {
    let heads = h as f64;
    (
        naive.total() * (t * h) as f64,
        chunk.total() * (t / c) as f64 * heads,
    )
}

fn bench(t: usize, h: usize, kd: usize, peak: f64) {
    const C: usize = 64;
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let g = inputs::kda(&KdaSpec {
        layout: Layout::batch(1, t),
        h,
        hv: h,
        k: kd,
        v: kd,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 0,
    });
    let naive = best_of(REPS, || {
        kda::naive::forward(&g.inputs, &opts).expect("valid");
        kda::naive::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
    });
    let chunk = best_of(REPS, || {
        kda::chunk::forward(&g.inputs, &opts, C).expect("valid");
        kda::chunk::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht), C).expect("valid");
    });
    let (n_ops, c_ops) = counts(t, h, C, ops::kda_naive(kd, kd), ops::kda_chunk(C, kd, kd));
    println!(
        "K=V={kd:<4} kda   {}   {}",
        rate("naive", naive, n_ops, peak),
        rate("chunk(C=64)", chunk, c_ops, peak)
    );
    let d = inputs::dplr(&DplrSpec {
        layout: Layout::batch(1, t),
        h,
        k: kd,
        v: kd,
        initial_state: true,
        seed: 0,
    });
    let dopts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let naive = best_of(REPS, || {
        dplr::naive::forward(&d.inputs, &dopts).expect("valid");
        dplr::naive::backward(&d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
    });
    let chunk = best_of(REPS, || {
        dplr::chunk::forward(&d.inputs, &dopts, C).expect("valid");
        dplr::chunk::backward(&d.inputs, &dopts, &d.d_o, Some(&d.dht), C).expect("valid");
    });
    let (n_ops, c_ops) = counts(t, h, C, ops::dplr_naive(kd, kd), ops::dplr_chunk(C, kd, kd));
    println!(
        "K=V={kd:<4} dplr  {}   {}",
        rate("naive", naive, n_ops, peak),
        rate("chunk(C=64)", chunk, c_ops, peak)
    );
}
