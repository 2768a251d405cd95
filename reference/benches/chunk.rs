//! Chunked vs naive forward+backward (issue 4): B=1, T=4096, H=4, K=V=128, f64.
//! Run: `cargo bench -p deltaref-reference --bench chunk`.

mod common;

use common::best_of;

use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};

fn main() {
    let (t, h, kd, vd) = (4096, 4, 128, 128);
    println!(
        "forward+backward, f64, B=1 T={t} H={h} K=V={kd}, {} rayon threads, best of 2",
        rayon::current_num_threads()
    );
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let g = inputs::kda(&KdaSpec {
        layout: Layout::batch(1, t),
        h,
        hv: h,
        k: kd,
        v: vd,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 0,
    });
    let naive = best_of(2, || {
        kda::naive::forward(&g.inputs, &opts).expect("valid");
        kda::naive::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
    });
    let chunk = best_of(2, || {
        kda::chunk::forward(&g.inputs, &opts, 64).expect("valid");
        kda::chunk::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht), 64).expect("valid");
    });
    println!("kda   naive {naive:8.3} s   chunk(C=64) {chunk:8.3} s");
    let d = inputs::dplr(&DplrSpec {
        layout: Layout::batch(1, t),
        h,
        k: kd,
        v: vd,
        initial_state: true,
        seed: 0,
    });
    let dopts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let naive = best_of(2, || {
        dplr::naive::forward(&d.inputs, &dopts).expect("valid");
        dplr::naive::backward(&d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
    });
    let chunk = best_of(2, || {
        dplr::chunk::forward(&d.inputs, &dopts, 64).expect("valid");
        dplr::chunk::backward(&d.inputs, &dopts, &d.d_o, Some(&d.dht), 64).expect("valid");
    });
    println!("dplr  naive {naive:8.3} s   chunk(C=64) {chunk:8.3} s");
}
