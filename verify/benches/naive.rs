//! Naive forward+backward timings (issue 2 target: < 0.05 s each in f64 for
//! B=1, T=1024, H=4, K=V=64 on a 2-core machine; FLA's PyTorch naive takes
//! about 2.2 s (KDA) and 3.3 s (DPLR) for the same job).
//! Run: `cargo bench -p deltaref-verify --bench naive`.

mod common;

use common::{MAX_ROUNDS, MIN_ROUNDS, ROUND_BUDGET_S};

use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};
use deltaref::op::{self, Engine, OpSpec, Operator};
use ndarray::ArrayD;

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
    let g = inputs::KdaSpec::generate(&spec);
    let kda = jobs(&kda::Naive, &g.inputs, &opts, &g.d_o, &g.dht);
    let d = inputs::DplrSpec::generate(&DplrSpec {
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
    let dplr = jobs(&dplr::Naive, &d.inputs, &dopts, &d.d_o, &d.dht);
    let jobs: Vec<&dyn Fn()> = kda.iter().chain(&dplr).map(|j| &**j).collect();
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

/// `engine`'s forward then backward (two calls, as a caller without
/// [`op::forward_backward`] runs them), its forward alone, its backward
/// alone.
fn jobs<'a, E: Engine<f64>>(
    engine: &'a E,
    x: &'a <E::Op as Operator<f64>>::Inputs,
    opts: &'a <E::Op as OpSpec>::Options,
    d_o: &'a ArrayD<f64>,
    dht: &'a ArrayD<f64>,
) -> [Box<dyn Fn() + 'a>; 3] {
    let forward = move || {
        op::forward(engine, x, opts).expect("valid");
    };
    let backward = move || {
        op::backward(engine, x, opts, d_o, Some(dht)).expect("valid");
    };
    [
        Box::new(move || {
            forward();
            backward();
        }),
        Box::new(forward),
        Box::new(backward),
    ]
}
