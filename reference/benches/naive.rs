//! Naive forward+backward timings (issue 2 target: < 0.05 s each in f64 for
//! B=1, T=1024, H=4, K=V=64 on a 2-core machine; FLA's PyTorch naive takes
//! about 2.2 s (KDA) and 3.3 s (DPLR) for the same job).
//! Run: `cargo bench -p deltaref --bench naive`.

mod common;

use common::best_of;

use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};

fn main() {
    common::tune_allocator();
    let (t, h, kd, vd) = (1024, 4, 64, 64);
    let threads = rayon::current_num_threads();
    println!(
        "naive forward+backward, f64, B=1 T={t} H={h} K=V={kd}, {threads} rayon threads, mimalloc"
    );

    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: Layout::batch(1, t),
        h,
        hv: h,
        k: kd,
        v: vd,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 0,
    };
    let g = inputs::kda(&spec);
    let kda_s = best_of(5, || {
        kda::naive::forward(&g.inputs, &opts).expect("valid");
        kda::naive::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
    });
    println!(
        "kda  naive fwd+bwd: {:8.4} s   (FLA torch naive ~2.2 s; target < 0.05 s)",
        kda_s
    );
    let fwd = best_of(5, || {
        kda::naive::forward(&g.inputs, &opts).expect("valid");
    });
    let bwd = best_of(5, || {
        kda::naive::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
    });
    println!("     forward {fwd:8.4} s, backward {bwd:8.4} s");

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
    let dplr_s = best_of(5, || {
        dplr::naive::forward(&d.inputs, &dopts).expect("valid");
        dplr::naive::backward(&d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
    });
    println!(
        "dplr naive fwd+bwd: {:8.4} s   (FLA torch naive ~3.3 s; target < 0.05 s)",
        dplr_s
    );
    let fwd = best_of(5, || {
        dplr::naive::forward(&d.inputs, &dopts).expect("valid");
    });
    let bwd = best_of(5, || {
        dplr::naive::backward(&d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
    });
    println!("     forward {fwd:8.4} s, backward {bwd:8.4} s");
}
