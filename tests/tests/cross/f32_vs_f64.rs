//! The same code in f32 stays within 1e-4 norm_ratio of f64 at T = 256, for
//! outputs and every gradient.

use deltaref::dplr::{self, DplrOptions};
use deltaref::gates::Gate;
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout, TokenShiftSpec};
use deltaref::kda::{self, KdaOptions};
use deltaref::op;
use deltaref::tensor::cast;
use deltaref::token_shift;
use deltaref_tests::ratio;
use ndarray::ArrayD;

const TOL: f64 = 1e-4;

fn close(name: &str, f64v: &ArrayD<f64>, f32v: &ArrayD<f32>) {
    let r = ratio(f64v, &cast(f32v));
    assert!(r <= TOL, "{name}: f32 vs f64 norm_ratio {r:e} > {TOL:e}");
}

#[test]
fn kda_f32_tracks_f64() {
    let opts = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::LowerBound { lower_bound: -5.0 },
        use_beta_sigmoid_in_kernel: true,
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: Layout::varlen(&[100, 1, 155]),
        h: 2,
        hv: 4,
        k: 16,
        v: 16,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 11,
    };
    let g = inputs::KdaSpec::generate(&spec);
    let x32 = g.inputs.cast::<f32>();
    let (do32, dht32) = (cast::<f64, f32>(&g.d_o), cast::<f64, f32>(&g.dht));
    let o64 = op::forward(&kda::Naive, &g.inputs, &opts).expect("valid");
    let o32 = op::forward(&kda::Naive, &x32, &opts).expect("valid");
    close("o", &o64.o, &o32.o);
    close(
        "final_state",
        o64.final_state.as_ref().unwrap(),
        o32.final_state.as_ref().unwrap(),
    );
    let g64 = op::backward(&kda::Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
    let g32 = op::backward(&kda::Naive, &x32, &opts, &do32, Some(&dht32)).expect("valid");
    close("dq", &g64.dq, &g32.dq);
    close("dk", &g64.dk, &g32.dk);
    close("dv", &g64.dv, &g32.dv);
    close("dg", &g64.dg, &g32.dg);
    close("dbeta", &g64.dbeta, &g32.dbeta);
    close(
        "dA_log",
        g64.da_log.as_ref().unwrap(),
        g32.da_log.as_ref().unwrap(),
    );
    close(
        "ddt_bias",
        g64.ddt_bias.as_ref().unwrap(),
        g32.ddt_bias.as_ref().unwrap(),
    );
    close("dh0", g64.dh0.as_ref().unwrap(), g32.dh0.as_ref().unwrap());
}

#[test]
fn dplr_f32_tracks_f64() {
    let spec = DplrSpec {
        layout: Layout::batch(2, 256),
        h: 2,
        k: 16,
        v: 16,
        initial_state: true,
        seed: 12,
    };
    let g = inputs::DplrSpec::generate(&spec);
    let opts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let x32 = g.inputs.cast::<f32>();
    let (do32, dht32) = (cast::<f64, f32>(&g.d_o), cast::<f64, f32>(&g.dht));
    let o64 = op::forward(&dplr::Naive, &g.inputs, &opts).expect("valid");
    let o32 = op::forward(&dplr::Naive, &x32, &opts).expect("valid");
    close("o", &o64.o, &o32.o);
    close(
        "final_state",
        o64.final_state.as_ref().unwrap(),
        o32.final_state.as_ref().unwrap(),
    );
    let g64 = op::backward(&dplr::Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
    let g32 = op::backward(&dplr::Naive, &x32, &opts, &do32, Some(&dht32)).expect("valid");
    for (n, a, b) in [
        ("dq", &g64.dq, &g32.dq),
        ("dk", &g64.dk, &g32.dk),
        ("dv", &g64.dv, &g32.dv),
        ("da", &g64.da, &g32.da),
        ("db", &g64.db, &g32.db),
        ("dgk", &g64.dgk, &g32.dgk),
    ] {
        close(n, a, b);
    }
    close("dh0", g64.dh0.as_ref().unwrap(), g32.dh0.as_ref().unwrap());
}

#[test]
fn token_shift_f32_tracks_f64() {
    let g = inputs::TokenShiftSpec::generate(&TokenShiftSpec {
        layout: Layout::varlen(&[200, 56]),
        d: 8,
        cache: true,
        seed: 13,
    });
    let x32 = g.inputs.cast::<f32>();
    let y64 = op::forward(&token_shift::Shift, &g.inputs, &()).expect("valid");
    let y32 = op::forward(&token_shift::Shift, &x32, &()).expect("valid");
    close("y", &y64.y, &y32.y);
    let d64 =
        op::backward(&token_shift::Shift, &g.inputs, &(), &g.d_o, Some(&g.dht)).expect("valid");
    let d32 = op::backward(
        &token_shift::Shift,
        &x32,
        &(),
        &cast(&g.d_o),
        Some(&cast(&g.dht)),
    )
    .expect("valid");
    close("dx", &d64.dx, &d32.dx);
    close(
        "dcache",
        d64.dcache.as_ref().unwrap(),
        d32.dcache.as_ref().unwrap(),
    );
}
