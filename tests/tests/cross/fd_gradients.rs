//! Every analytic gradient of the naive oracle against central finite
//! differences in f64 (norm_ratio ≤ 1e-6), on small shapes covering GVA,
//! varlen with length-0 and length-1 sequences, initial state and dht, each
//! gate variant, l2norm on and off, and the beta sigmoid.

use deltaref::dplr::{self, DplrInputs, DplrOptions};
use deltaref::gates::Gate;
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout, TokenShiftSpec};
use deltaref::kda::{self, KdaInputs, KdaOptions};
use deltaref::op;
use deltaref::token_shift::{self, TokenShiftInputs};
use deltaref_tests::{check_grad, dplr_loss, kda_loss, token_shift_loss};

const TOL: f64 = 1e-6;

fn kda_case(layout: Layout, opts: KdaOptions, scalar_gate: bool, seed: u64) {
    let spec = KdaSpec {
        layout,
        h: 2,
        hv: 4,
        k: 3,
        v: 2,
        opts,
        initial_state: true,
        scalar_gate,
        seed,
    };
    let g = inputs::KdaSpec::generate(&spec);
    let x = &g.inputs;
    let gr = op::backward(&kda::Naive, x, &opts, &g.d_o, Some(&g.dht)).expect("valid");
    let loss = |x: KdaInputs<f64>| kda_loss(&x, &opts, &g.d_o, &g.dht);
    let tag = |n: &str| format!("{n} ({opts:?}, scalar_gate={scalar_gate})");
    check_grad(&tag("dq"), Some(&gr.dq), &x.q, TOL, |t| {
        loss(KdaInputs {
            q: t.clone(),
            ..x.clone()
        })
    });
    check_grad(&tag("dk"), Some(&gr.dk), &x.k, TOL, |t| {
        loss(KdaInputs {
            k: t.clone(),
            ..x.clone()
        })
    });
    check_grad(&tag("dv"), Some(&gr.dv), &x.v, TOL, |t| {
        loss(KdaInputs {
            v: t.clone(),
            ..x.clone()
        })
    });
    check_grad(&tag("dg"), Some(&gr.dg), &x.g, TOL, |t| {
        loss(KdaInputs {
            g: t.clone(),
            ..x.clone()
        })
    });
    check_grad(&tag("dbeta"), Some(&gr.dbeta), &x.beta, TOL, |t| {
        loss(KdaInputs {
            beta: t.clone(),
            ..x.clone()
        })
    });
    let h0 = x.initial_state.as_ref().expect("generated");
    check_grad(&tag("dh0"), gr.dh0.as_ref(), h0, TOL, |t| {
        loss(KdaInputs {
            initial_state: Some(t.clone()),
            ..x.clone()
        })
    });
    if let Some(a) = &x.a_log {
        check_grad(&tag("dA_log"), gr.da_log.as_ref(), a, TOL, |t| {
            loss(KdaInputs {
                a_log: Some(t.clone()),
                ..x.clone()
            })
        });
    }
    if let Some(b) = &x.dt_bias {
        check_grad(&tag("ddt_bias"), gr.ddt_bias.as_ref(), b, TOL, |t| {
            loss(KdaInputs {
                dt_bias: Some(t.clone()),
                ..x.clone()
            })
        });
    }
}

fn varlen() -> Layout {
    Layout::varlen(&[7, 0, 1, 12])
}

#[test]
fn kda_plain_gates_with_and_without_l2norm() {
    for l2 in [false, true] {
        let opts = KdaOptions {
            use_qk_l2norm_in_kernel: l2,
            ..Default::default()
        };
        kda_case(varlen(), opts, false, 1);
        kda_case(Layout::batch(2, 9), opts, false, 2);
    }
}

#[test]
fn kda_in_kernel_gates() {
    for gate in [Gate::Kda, Gate::LowerBound { lower_bound: -5.0 }] {
        let opts = KdaOptions {
            gate,
            use_qk_l2norm_in_kernel: true,
            ..Default::default()
        };
        kda_case(varlen(), opts, false, 3);
    }
}

#[test]
fn kda_lower_bound_gate_without_a_log_or_dt_bias() {
    let opts = KdaOptions {
        gate: Gate::LowerBound { lower_bound: -3.0 },
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: varlen(),
        h: 1,
        hv: 2,
        k: 3,
        v: 2,
        opts,
        initial_state: false,
        scalar_gate: false,
        seed: 4,
    };
    let g = inputs::KdaSpec::generate(&spec);
    let x = KdaInputs {
        a_log: None,
        dt_bias: None,
        ..g.inputs.clone()
    };
    let gr = op::backward(&kda::Naive, &x, &opts, &g.d_o, Some(&g.dht)).expect("valid");
    assert!(gr.da_log.is_none() && gr.ddt_bias.is_none() && gr.dh0.is_none());
    check_grad("dg (lower bound, no A_log)", Some(&gr.dg), &x.g, TOL, |t| {
        kda_loss(
            &KdaInputs {
                g: t.clone(),
                ..x.clone()
            },
            &opts,
            &g.d_o,
            &g.dht,
        )
    });
}

#[test]
fn kda_beta_sigmoid_and_negative_eigenvalues() {
    for allow_neg_eigval in [false, true] {
        let opts = KdaOptions {
            use_beta_sigmoid_in_kernel: true,
            allow_neg_eigval,
            ..Default::default()
        };
        kda_case(varlen(), opts, false, 5);
    }
}

#[test]
fn kda_scalar_gate_per_head() {
    kda_case(
        varlen(),
        KdaOptions {
            scale: Some(0.37),
            ..Default::default()
        },
        true,
        6,
    );
}

fn dplr_case(layout: Layout, seed: u64) {
    let spec = DplrSpec {
        layout,
        h: 2,
        k: 3,
        v: 2,
        initial_state: true,
        seed,
    };
    let g = inputs::DplrSpec::generate(&spec);
    let x = &g.inputs;
    let opts = DplrOptions::default();
    let gr = op::backward(&dplr::Naive, x, &opts, &g.d_o, Some(&g.dht)).expect("valid");
    let loss = |x: DplrInputs<f64>| dplr_loss(&x, &opts, &g.d_o, &g.dht);
    check_grad("dq", Some(&gr.dq), &x.q, TOL, |t| {
        loss(DplrInputs {
            q: t.clone(),
            ..x.clone()
        })
    });
    check_grad("dk", Some(&gr.dk), &x.k, TOL, |t| {
        loss(DplrInputs {
            k: t.clone(),
            ..x.clone()
        })
    });
    check_grad("dv", Some(&gr.dv), &x.v, TOL, |t| {
        loss(DplrInputs {
            v: t.clone(),
            ..x.clone()
        })
    });
    check_grad("da", Some(&gr.da), &x.a, TOL, |t| {
        loss(DplrInputs {
            a: t.clone(),
            ..x.clone()
        })
    });
    check_grad("db", Some(&gr.db), &x.b, TOL, |t| {
        loss(DplrInputs {
            b: t.clone(),
            ..x.clone()
        })
    });
    check_grad("dgk", Some(&gr.dgk), &x.gk, TOL, |t| {
        loss(DplrInputs {
            gk: t.clone(),
            ..x.clone()
        })
    });
    check_grad(
        "dh0",
        gr.dh0.as_ref(),
        x.initial_state.as_ref().expect("generated"),
        TOL,
        |t| {
            loss(DplrInputs {
                initial_state: Some(t.clone()),
                ..x.clone()
            })
        },
    );
}

#[test]
fn dplr_varlen_and_batch() {
    dplr_case(varlen(), 7);
    dplr_case(Layout::batch(2, 9), 8);
}

#[test]
fn token_shift_varlen_and_batch_with_cache() {
    for (layout, cache) in [
        (varlen(), true),
        (varlen(), false),
        (Layout::batch(3, 4), true),
    ] {
        let spec = TokenShiftSpec {
            layout,
            d: 3,
            cache,
            seed: 9,
        };
        let g = inputs::TokenShiftSpec::generate(&spec);
        let x = &g.inputs;
        let gr = op::backward(&token_shift::Shift, x, &(), &g.d_o, Some(&g.dht)).expect("valid");
        let loss = |x: TokenShiftInputs<f64>| token_shift_loss(&x, &g.d_o, &g.dht);
        check_grad("dx", Some(&gr.dx), &x.x, TOL, |t| {
            loss(TokenShiftInputs {
                x: t.clone(),
                ..x.clone()
            })
        });
        if let Some(c) = &x.cache {
            check_grad("dcache", gr.dcache.as_ref(), c, TOL, |t| {
                loss(TokenShiftInputs {
                    cache: Some(t.clone()),
                    ..x.clone()
                })
            });
        }
    }
}
