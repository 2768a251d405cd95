//! Naive forward+backward timings (issue 2 target: < 0.05 s each in f64 for
//! B=1, T=1024, H=4, K=V=64 on a 2-core machine; FLA's PyTorch naive takes
//! about 2.2 s (KDA) and 3.3 s (DPLR) for the same job).
//! Run: `cargo bench -p deltaref --bench naive`.

mod common;

use common::{MAX_ROUNDS, MIN_ROUNDS, ROUND_BUDGET_S};

use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};

fn main() {
    common::tune_allocator();
    let (t, h, kd, vd) = (1024, 4, 64, 64);
    let threads = rayon::current_num_threads();
    println!(
        "naive forward+backward, f64, B=1 T={t} H={h} K=V={kd}, {threads} rayon threads, mimalloc, \
         best of {MIN_ROUNDS} to {MAX_ROUNDS} interleaved rounds (~{ROUND_BUDGET_S} s)"
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
    let kda: [&dyn Fn(); 3] = [
        &|| {
            kda::naive::forward(&g.inputs, &opts).expect("valid");
            kda::naive::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
        },
        &|| {
            kda::naive::forward(&g.inputs, &opts).expect("valid");
        },
        &|| {
            kda::naive::backward(&g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
        },
    ];
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
    let dplr: [&dyn Fn(); 3] = [
        &|| {
            dplr::naive::forward(&d.inputs, &dopts).expect("valid");
            dplr::naive::backward(&d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
        },
        &|| {
            dplr::naive::forward(&d.inputs, &dopts).expect("valid");
        },
        &|| {
            dplr::naive::backward(&d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
        },
    ];
    let jobs: Vec<&dyn Fn()> = kda.into_iter().chain(dplr).collect();
    let rounds = common::rounds(&jobs);
    let best = |i| rounds.best(i).expect("rounds ran");
    for (i, (op, fla)) in [("kda ", 2.2), ("dplr", 3.3)].into_iter().enumerate() {
        println!(
            "{op} naive fwd+bwd: {:8.4} s   (FLA torch naive ~{fla} s; target < 0.05 s)",
            best(3 * i)
        );
        println!(
            "     forward {:8.4} s, backward {:8.4} s",
            best(3 * i + 1),
            best(3 * i + 2)
        );
    }
}
