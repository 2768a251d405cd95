//! Bad input is a typed error naming the tensor, the expected and the actual
//! shape — never a panic, never a silent answer.

use deltaref::dplr::{self, DplrOptions};
use deltaref::gates::Gate;
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout, TokenShiftSpec};
use deltaref::kda::{self, KdaInputs, KdaOptions};
use deltaref::op;
use deltaref::token_shift;
use deltaref::Error;
use ndarray::{ArrayD, IxDyn};

fn kda_spec(opts: KdaOptions) -> KdaSpec {
    KdaSpec {
        layout: Layout::varlen(&[3, 2]),
        h: 2,
        hv: 4,
        k: 3,
        v: 2,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 1,
    }
}

fn kda_err(x: &KdaInputs<f64>, opts: &KdaOptions) -> Error {
    op::forward(&kda::Naive, x, opts).expect_err("must be rejected")
}

fn shape_err_names(e: &Error, tensor: &str) {
    match e {
        Error::Shape {
            tensor: t,
            expected,
            got,
        } => {
            assert_eq!(t, tensor, "{e}");
            assert!(!expected.is_empty() && !got.is_empty(), "{e}");
            let msg = e.to_string();
            assert!(msg.contains(tensor) && msg.contains("expected"), "{msg}");
        }
        other => panic!("expected a shape error on `{tensor}`, got {other}"),
    }
}

fn zeros(shape: &[usize]) -> ArrayD<f64> {
    ArrayD::zeros(IxDyn(shape))
}

#[test]
fn kda_wrong_shapes_name_the_tensor() {
    let opts = KdaOptions::default();
    let x = inputs::KdaSpec::generate(&kda_spec(opts)).inputs;
    shape_err_names(
        &kda_err(
            &KdaInputs {
                q: zeros(&[1, 5, 2]),
                ..x.clone()
            },
            &opts,
        ),
        "q",
    );
    shape_err_names(
        &kda_err(
            &KdaInputs {
                k: zeros(&[1, 5, 2, 4]),
                ..x.clone()
            },
            &opts,
        ),
        "k",
    );
    shape_err_names(
        &kda_err(
            &KdaInputs {
                v: zeros(&[1, 4, 4, 2]),
                ..x.clone()
            },
            &opts,
        ),
        "v",
    );
    shape_err_names(
        &kda_err(
            &KdaInputs {
                g: zeros(&[1, 5, 4, 2]),
                ..x.clone()
            },
            &opts,
        ),
        "g",
    );
    shape_err_names(
        &kda_err(
            &KdaInputs {
                beta: zeros(&[1, 5, 2]),
                ..x.clone()
            },
            &opts,
        ),
        "beta",
    );
    shape_err_names(
        &kda_err(
            &KdaInputs {
                initial_state: Some(zeros(&[3, 4, 3, 2])),
                ..x.clone()
            },
            &opts,
        ),
        "initial_state",
    );
    // HV = 3 is not a multiple of H = 2.
    let bad = KdaInputs {
        v: zeros(&[1, 5, 3, 2]),
        g: zeros(&[1, 5, 3, 3]),
        beta: zeros(&[1, 5, 3]),
        ..x.clone()
    };
    let e = kda_err(&bad, &opts);
    shape_err_names(&e, "v");
    assert!(e.to_string().contains("multiple of H"), "{e}");
}

#[test]
fn kda_upstream_gradient_shapes_are_checked() {
    let opts = KdaOptions::default();
    let g = inputs::KdaSpec::generate(&kda_spec(opts));
    let e = op::backward(&kda::Naive, &g.inputs, &opts, &zeros(&[1, 5, 4, 3]), None)
        .expect_err("bad do");
    shape_err_names(&e, "do");
    let e = op::backward(
        &kda::Naive,
        &g.inputs,
        &opts,
        &g.d_o,
        Some(&zeros(&[1, 4, 3, 2])),
    )
    .expect_err("bad dht");
    shape_err_names(&e, "dht");
}

#[test]
fn cu_seqlens_errors() {
    let opts = KdaOptions::default();
    let x = inputs::KdaSpec::generate(&kda_spec(opts)).inputs;
    for (cu, needle) in [
        (vec![1, 3, 5], "start at 0"),
        (vec![0, 4, 3, 5], "non-decreasing"),
        (vec![0, 3, 4], "end at T = 5"),
        (vec![0], "at least 2"),
    ] {
        let e = kda_err(
            &KdaInputs {
                cu_seqlens: Some(cu.clone()),
                ..x.clone()
            },
            &opts,
        );
        assert!(matches!(e, Error::CuSeqlens(_)), "{cu:?}: {e}");
        assert!(e.to_string().contains(needle), "{cu:?}: {e}");
    }
    // Varlen with B = 2.
    let b2 = inputs::KdaSpec::generate(&KdaSpec {
        layout: Layout::batch(2, 5),
        initial_state: false,
        ..kda_spec(opts)
    })
    .inputs;
    let e = kda_err(
        &KdaInputs {
            cu_seqlens: Some(vec![0, 5]),
            ..b2
        },
        &opts,
    );
    assert!(e.to_string().contains("B = 1"), "{e}");
}

#[test]
fn non_finite_values_are_rejected_with_their_index() {
    let opts = KdaOptions::default();
    let x = inputs::KdaSpec::generate(&kda_spec(opts)).inputs;
    let poison = |mut a: ArrayD<f64>, v: f64| {
        a[[0, 2, 1, 0]] = v;
        a
    };
    for (name, bad) in [
        (
            "q",
            KdaInputs {
                q: poison(x.q.clone(), f64::NAN),
                ..x.clone()
            },
        ),
        (
            "k",
            KdaInputs {
                k: poison(x.k.clone(), f64::INFINITY),
                ..x.clone()
            },
        ),
        (
            "v",
            KdaInputs {
                v: poison(x.v.clone(), f64::NEG_INFINITY),
                ..x.clone()
            },
        ),
        (
            "g",
            KdaInputs {
                g: poison(x.g.clone(), f64::NAN),
                ..x.clone()
            },
        ),
        (
            "initial_state",
            KdaInputs {
                initial_state: Some(poison(x.initial_state.clone().unwrap(), f64::NAN)),
                ..x.clone()
            },
        ),
    ] {
        match kda_err(&bad, &opts) {
            Error::NonFinite { tensor, index, .. } => {
                assert_eq!(tensor, name);
                assert_eq!(index, vec![0, 2, 1, 0]);
            }
            other => panic!("{name}: expected NonFinite, got {other}"),
        }
    }
    let mut beta = x.beta.clone();
    beta[[0, 1, 3]] = f64::NAN;
    assert!(
        matches!(kda_err(&KdaInputs { beta, ..x.clone() }, &opts), Error::NonFinite { ref tensor, .. } if tensor == "beta")
    );
    let g = inputs::KdaSpec::generate(&kda_spec(opts));
    let mut d_o = g.d_o.clone();
    d_o[[0, 0, 0, 0]] = f64::NAN;
    let e = op::backward(&kda::Naive, &g.inputs, &opts, &d_o, None).expect_err("NaN in do");
    assert!(
        matches!(e, Error::NonFinite { ref tensor, .. } if tensor == "do"),
        "{e}"
    );
}

#[test]
fn gate_options_need_their_tensors() {
    let kda_gate = KdaOptions {
        gate: Gate::Kda,
        ..Default::default()
    };
    let x = inputs::KdaSpec::generate(&kda_spec(kda_gate)).inputs;
    let e = kda_err(
        &KdaInputs {
            a_log: None,
            ..x.clone()
        },
        &kda_gate,
    );
    assert!(
        matches!(e, Error::Missing { ref tensor, .. } if tensor == "A_log"),
        "{e}"
    );
    shape_err_names(
        &kda_err(
            &KdaInputs {
                a_log: Some(zeros(&[3])),
                ..x.clone()
            },
            &kda_gate,
        ),
        "A_log",
    );
    shape_err_names(
        &kda_err(
            &KdaInputs {
                dt_bias: Some(zeros(&[4])),
                ..x.clone()
            },
            &kda_gate,
        ),
        "dt_bias",
    );
    // A_log given without an in-kernel gate is a mistake, not silently ignored.
    let e = kda_err(&x, &KdaOptions::default());
    assert!(
        matches!(e, Error::Option { ref option, .. } if option == "gate"),
        "{e}"
    );
    let bad_lb = KdaOptions {
        gate: Gate::LowerBound { lower_bound: 1.0 },
        ..Default::default()
    };
    let e = kda_err(&x, &bad_lb);
    assert!(
        matches!(e, Error::Option { ref option, .. } if option == "lower_bound"),
        "{e}"
    );
    let neg = KdaOptions {
        allow_neg_eigval: true,
        ..Default::default()
    };
    let plain = inputs::KdaSpec::generate(&kda_spec(KdaOptions::default())).inputs;
    let e = kda_err(&plain, &neg);
    assert!(
        matches!(e, Error::Option { ref option, .. } if option == "allow_neg_eigval"),
        "{e}"
    );
    let e = kda_err(
        &plain,
        &KdaOptions {
            scale: Some(f64::NAN),
            ..Default::default()
        },
    );
    assert!(
        matches!(e, Error::Option { ref option, .. } if option == "scale"),
        "{e}"
    );
}

#[test]
fn dplr_and_token_shift_errors() {
    let g = inputs::DplrSpec::generate(&DplrSpec {
        layout: Layout::varlen(&[3, 2]),
        h: 2,
        k: 3,
        v: 2,
        initial_state: false,
        seed: 1,
    });
    let opts = DplrOptions::default();
    for name in ["a", "b", "gk"] {
        let mut x = g.inputs.clone();
        let bad = zeros(&[1, 5, 2, 4]);
        match name {
            "a" => x.a = bad,
            "b" => x.b = bad,
            _ => x.gk = bad,
        }
        shape_err_names(
            &op::forward(&dplr::Naive, &x, &opts).expect_err("bad"),
            name,
        );
    }
    let mut x = g.inputs.clone();
    x.gk[[0, 1, 1, 1]] = f64::INFINITY;
    assert!(
        matches!(op::forward(&dplr::Naive, &x, &opts), Err(Error::NonFinite { ref tensor, .. }) if tensor == "gk")
    );

    let t = inputs::TokenShiftSpec::generate(&TokenShiftSpec {
        layout: Layout::varlen(&[3, 2]),
        d: 4,
        cache: true,
        seed: 1,
    });
    let mut x = t.inputs.clone();
    x.cache = Some(zeros(&[3, 4]));
    shape_err_names(
        &op::forward(&token_shift::Shift, &x, &()).expect_err("bad cache"),
        "cache",
    );
    let e = op::backward(
        &token_shift::Shift,
        &t.inputs,
        &(),
        &zeros(&[1, 5, 3]),
        None,
    )
    .expect_err("bad dy");
    shape_err_names(&e, "dy");
    let mut x = t.inputs.clone();
    x.cu_seqlens = Some(vec![0, 6]);
    assert!(matches!(
        op::forward(&token_shift::Shift, &x, &()),
        Err(Error::CuSeqlens(_))
    ));
}
