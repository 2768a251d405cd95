//! Chunked vs naive forward+backward, f64, B=1 T=1024 H=4 at K=V=64 and
//! K=V=128 (issue 20: chunk at least as fast as naive).
//! Run: `cargo bench -p deltaref-reference --bench chunk`.

mod common;

use common::best_of;

use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};

const REPS: usize = 5;

fn main() {
    let (t, h) = (1024, 4);
    println!(
        "forward+backward, f64, B=1 T={t} H={h}, {} rayon threads, best of {REPS}",
        rayon::current_num_threads()
    );
    for kd in [64, 128] {
        bench(t, h, kd);
    }
}

fn bench(t: usize, h: usize, kd: usize) {
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
        kda::chunk::forward(&g.inputs, &opts, 64).expect("valid");
        kda::chunk::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht), 64).expect("valid");
    });
    println!(
        "K=V={kd:<4} kda   naive {:8.2} ms   chunk(C=64) {:8.2} ms",
        naive * 1e3,
        chunk * 1e3
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
        dplr::chunk::forward(&d.inputs, &dopts, 64).expect("valid");
        dplr::chunk::backward(&d.inputs, &dopts, &d.d_o, Some(&d.dht), 64).expect("valid");
    });
    println!(
        "K=V={kd:<4} dplr  naive {:8.2} ms   chunk(C=64) {:8.2} ms",
        naive * 1e3,
        chunk * 1e3
    );
}
