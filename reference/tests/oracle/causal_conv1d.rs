//! Causal conv1d: CP vs non-CP for any cut (ranks shorter than `W − 1`
//! tokens, cuts near sequence starts), state chaining (one call = two calls
//! handing `final_state` on as `initial_state`), varlen = batch, a direct
//! convolution, finite differences for every gradient, f32 vs f64, bad inputs.

use crate::common;

use common::{assert_close, assert_close_opt, check_grad, dot};
use deltaref::conv::{self, Activation, ConvGrads, ConvInputs, ConvOptions, Direct};
use deltaref::cp::PlanSpec;
use deltaref::cp::{self, CpOptions};
use deltaref::error::Error;
use deltaref::inputs::{self, ConvSpec, Layout};
use deltaref::op;
use ndarray::{s, Array3, ArrayD, Axis, Ix2, Ix3};

fn spec(layout: Layout, w: usize, bias: bool, initial_state: bool, seed: u64) -> ConvSpec {
    ConvSpec {
        layout,
        d: 6,
        w,
        bias,
        initial_state,
        seed,
    }
}

fn options(activation: Activation) -> ConvOptions {
    ConvOptions {
        activation,
        output_final_state: true,
    }
}

fn assert_grads(what: &str, r: &ConvGrads<f64>, x: &ConvGrads<f64>, tol: f64) {
    assert_close(&format!("{what} dx"), &r.dx, &x.dx, tol);
    assert_close(&format!("{what} dweight"), &r.dweight, &x.dweight, tol);
    assert_close_opt(&format!("{what} dbias"), &r.dbias, &x.dbias, tol);
    assert_close_opt(&format!("{what} dh0"), &r.dh0, &x.dh0, tol);
}

#[test]
fn cp_equals_non_cp_for_any_cut() {
    // Sequences of 0, 1, 2 tokens and cuts 1–2 tokens apart: windows reach
    // across several ranks and into the initial state.
    let layout = Layout::varlen(&[2, 0, 9, 1, 13, 7]);
    let plans = [
        PlanSpec::Cuts(vec![1, 3, 4, 5, 12, 19, 20, 27]),
        PlanSpec::Cuts(vec![11, 12]),
        PlanSpec::World(4),
        PlanSpec::Zigzag(2),
    ];
    for (w, bias, h0, act) in [
        (4, true, true, Activation::Silu),
        (3, false, true, Activation::None),
        (1, true, false, Activation::Silu),
        (4, false, false, Activation::None),
    ] {
        let g = inputs::ConvSpec::generate(&spec(layout.clone(), w, bias, h0, w as u64));
        let (x, opt) = (&g.inputs, options(act));
        let f = op::forward(&conv::Direct, x, &opt).unwrap();
        let b = op::backward(&conv::Direct, x, &opt, &g.d_o, Some(&g.dht)).unwrap();
        for plan in &plans {
            let tag = format!("{plan} W={w} bias={bias} h0={h0} {act:?}");
            let (fc, _) = cp::forward(&Direct, x, &opt, plan, &CpOptions::default()).unwrap();
            assert_close(&format!("{tag} y"), &f.y, &fc.y, 1e-10);
            assert_close_opt(
                &format!("{tag} final_state"),
                &f.final_state,
                &fc.final_state,
                1e-10,
            );
            let (bc, diags) = cp::backward(
                &Direct,
                x,
                &opt,
                &g.d_o,
                Some(&g.dht),
                plan,
                &CpOptions::default(),
            )
            .unwrap();
            assert_grads(&tag, &b, &bc, 1e-10);
            // The per-rank table's merged caches against its non-CP
            // references: an exact run agrees to rounding (with SiLU the
            // reference backward must start from the non-CP cache, not 0).
            for d in &diags {
                for (what, e) in [("cache in", d.h0_error()), ("dcache in", d.dht_error())] {
                    assert!(
                        e.is_none_or(|e| e <= 1e-10),
                        "{tag} rank {}: merged {what} vs non-CP off by {e:?}",
                        d.meta.rank
                    );
                }
            }
            let table = cp::table(&diags, deltaref::cp::Carry::Tokens);
            assert!(
                table.contains("|cache in|") && !table.contains("|M|") && !table.contains("S_ext"),
                "{table}"
            );
        }
    }
}

#[test]
fn one_call_equals_two_calls_chained_through_the_state() {
    let (w, t, cut) = (4, 11, 2);
    let g = inputs::ConvSpec::generate(&spec(Layout::batch(2, t), w, true, true, 5));
    let opt = options(Activation::Silu);
    let whole = op::forward(&conv::Direct, &g.inputs, &opt).unwrap();
    let part =
        |a: &ArrayD<f64>, r: std::ops::Range<usize>| a.slice(s![.., r, ..]).to_owned().into_dyn();
    let first = ConvInputs {
        x: part(&g.inputs.x, 0..cut),
        ..g.inputs.clone()
    };
    let f1 = op::forward(&conv::Direct, &first, &opt).unwrap();
    let second = ConvInputs {
        x: part(&g.inputs.x, cut..t),
        initial_state: f1.final_state.clone(),
        ..g.inputs.clone()
    };
    let f2 = op::forward(&conv::Direct, &second, &opt).unwrap();
    let y = ndarray::concatenate(Axis(1), &[f1.y.view(), f2.y.view()]).unwrap();
    assert_close("y", &whole.y, &y, 1e-15);
    assert_close(
        "final_state",
        whole.final_state.as_ref().unwrap(),
        f2.final_state.as_ref().unwrap(),
        0.0,
    );
}

#[test]
fn varlen_equals_batch_and_a_direct_convolution() {
    let (w, t, d) = (3, 8, 6);
    let g = inputs::ConvSpec::generate(&spec(Layout::batch(3, t), w, true, true, 9));
    let opt = options(Activation::None);
    let batch = op::forward(&conv::Direct, &g.inputs, &opt).unwrap();
    let packed = ConvInputs {
        x: g.inputs
            .x
            .clone()
            .into_shape_with_order(vec![1, 3 * t, d])
            .unwrap(),
        cu_seqlens: Some(vec![0, 8, 16, 24]),
        ..g.inputs.clone()
    };
    let var = op::forward(&conv::Direct, &packed, &opt).unwrap();
    assert_eq!(
        var.y.clone().into_shape_with_order(vec![3, t, d]).unwrap(),
        batch.y
    );
    assert_eq!(var.final_state, batch.final_state);
    // y_t[c] = Σ_i weight[c, i] · X[t + 1 + i, c] + bias[c], X = [h0; x].
    let x = g.inputs.x.view().into_dimensionality::<Ix3>().unwrap();
    let wt = g.inputs.weight.view().into_dimensionality::<Ix2>().unwrap();
    let h0 = g
        .inputs
        .initial_state
        .as_ref()
        .unwrap()
        .view()
        .into_dimensionality::<Ix3>()
        .unwrap();
    let bias = g.inputs.bias.as_ref().unwrap();
    let mut y = Array3::zeros((3, t, d));
    for (b, ti, c) in itertools(3, t, d) {
        let mut acc = bias[[c]];
        for i in 0..w {
            let m = ti + 1 + i;
            acc += wt[[c, i]]
                * if m < w {
                    h0[[b, c, m]]
                } else {
                    x[[b, m - w, c]]
                };
        }
        y[[b, ti, c]] = acc;
    }
    assert_close("direct y", &y.into_dyn(), &batch.y, 1e-15);
}

fn itertools(a: usize, b: usize, c: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..a).flat_map(move |i| (0..b).flat_map(move |j| (0..c).map(move |k| (i, j, k))))
}

#[test]
fn finite_differences_every_gradient() {
    // Sequence lengths 0 and 1 < W keep initial-state columns in final_state.
    for (w, act) in [
        (4, Activation::Silu),
        (3, Activation::None),
        (1, Activation::Silu),
    ] {
        let g = inputs::ConvSpec::generate(&spec(
            Layout::varlen(&[5, 0, 1, 7]),
            w,
            true,
            true,
            30 + w as u64,
        ));
        let (x, opt) = (&g.inputs, options(act));
        let gr = op::backward(&conv::Direct, x, &opt, &g.d_o, Some(&g.dht)).unwrap();
        let l = |x: ConvInputs<f64>| {
            let f = op::forward(&conv::Direct, &x, &opt).unwrap();
            dot(&f.y, &g.d_o) + dot(f.final_state.as_ref().unwrap(), &g.dht)
        };
        let tag = |n: &str| format!("{n} (W={w}, {act:?})");
        check_grad(&tag("dx"), Some(&gr.dx), &x.x, |t| {
            l(ConvInputs {
                x: t.clone(),
                ..x.clone()
            })
        });
        check_grad(&tag("dweight"), Some(&gr.dweight), &x.weight, |t| {
            l(ConvInputs {
                weight: t.clone(),
                ..x.clone()
            })
        });
        check_grad(
            &tag("dbias"),
            gr.dbias.as_ref(),
            x.bias.as_ref().unwrap(),
            |t| {
                l(ConvInputs {
                    bias: Some(t.clone()),
                    ..x.clone()
                })
            },
        );
        check_grad(
            &tag("dh0"),
            gr.dh0.as_ref(),
            x.initial_state.as_ref().unwrap(),
            |t| {
                l(ConvInputs {
                    initial_state: Some(t.clone()),
                    ..x.clone()
                })
            },
        );
    }
}

#[test]
fn f32_close_to_f64() {
    let g = inputs::ConvSpec::generate(&spec(Layout::varlen(&[40, 3, 21]), 4, true, true, 2));
    let opt = options(Activation::Silu);
    let x32 = g.inputs.cast::<f32>();
    let up = |a: &ArrayD<f32>| a.mapv(f64::from);
    let f64_ = op::forward(&conv::Direct, &g.inputs, &opt).unwrap();
    let f32_ = op::forward(&conv::Direct, &x32, &opt).unwrap();
    assert_close("f32 y", &f64_.y, &up(&f32_.y), 1e-6);
    let b64 = op::backward(&conv::Direct, &g.inputs, &opt, &g.d_o, Some(&g.dht)).unwrap();
    let b32 = op::backward(
        &conv::Direct,
        &x32,
        &opt,
        &g.d_o.mapv(|v| v as f32),
        Some(&g.dht.mapv(|v| v as f32)),
    )
    .unwrap();
    assert_close("f32 dweight", &b64.dweight, &up(&b32.dweight), 1e-6);
    assert_close("f32 dx", &b64.dx, &up(&b32.dx), 1e-6);
}

fn expect_err(x: &ConvInputs<f64>, tensor: &str) -> Error {
    let e = op::forward(&conv::Direct, x, &ConvOptions::default()).expect_err("must be refused");
    assert!(
        e.to_string().contains(tensor),
        "error for `{tensor}` does not name it: {e}"
    );
    e
}

#[test]
fn bad_inputs_are_refused_with_the_tensor_named() {
    let g = inputs::ConvSpec::generate(&spec(Layout::varlen(&[3, 4]), 3, true, true, 1)).inputs;
    for (weight, what) in [
        (vec![6, 0], "W = 0"),
        (vec![5, 3], "D mismatch"),
        (vec![6], "rank 1"),
    ] {
        let x = ConvInputs {
            weight: ArrayD::zeros(weight),
            ..g.clone()
        };
        assert!(
            matches!(expect_err(&x, "weight"), Error::Shape { .. }),
            "{what}"
        );
    }
    let x = ConvInputs {
        bias: Some(ArrayD::zeros(vec![5])),
        ..g.clone()
    };
    assert!(matches!(expect_err(&x, "bias"), Error::Shape { .. }));
    // FLA's cache is [N, D, W]: the [N, W, D] transpose is refused.
    let x = ConvInputs {
        initial_state: Some(ArrayD::zeros(vec![2, 3, 6])),
        ..g.clone()
    };
    assert!(matches!(
        expect_err(&x, "initial_state"),
        Error::Shape { .. }
    ));
    let x = ConvInputs {
        x: ArrayD::zeros(vec![7, 6]),
        ..g.clone()
    };
    assert!(matches!(expect_err(&x, "x"), Error::Shape { .. }));
    let mut x = g.clone();
    x.weight[[2, 1]] = f64::NAN;
    assert!(matches!(expect_err(&x, "weight"), Error::NonFinite { .. }));
    let mut x = g.clone();
    x.x[[0, 5, 0]] = f64::NEG_INFINITY;
    assert!(matches!(expect_err(&x, "x"), Error::NonFinite { .. }));
    let e = Activation::parse("gelu").expect_err("unknown activation");
    assert!(
        matches!(&e, Error::Option { option, .. } if option == "activation"),
        "{e}"
    );
    assert_eq!(Activation::parse("swish").unwrap(), Activation::Silu);
    let opt = ConvOptions::default();
    let e = op::backward(
        &conv::Direct,
        &g,
        &opt,
        &ArrayD::zeros(vec![1, 7, 6]),
        Some(&ArrayD::zeros(vec![2, 6, 2])),
    )
    .expect_err("dht [N,D,W]");
    assert!(e.to_string().contains("dht"), "{e}");
    let e = cp::forward(
        &Direct,
        &ConvInputs {
            x: ArrayD::zeros(vec![2, 3, 6]),
            cu_seqlens: None,
            initial_state: None,
            ..g.clone()
        },
        &opt,
        &PlanSpec::World(2),
        &CpOptions::default(),
    )
    .expect_err("CP needs B = 1");
    assert!(matches!(e, Error::Partition(_)), "{e}");
}

#[test]
fn bit_identical_for_any_thread_count() {
    let g = inputs::ConvSpec::generate(&spec(Layout::varlen(&[30, 1, 29]), 4, true, true, 12));
    let opt = options(Activation::Silu);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let b = op::backward(&conv::Direct, &g.inputs, &opt, &g.d_o, Some(&g.dht)).unwrap();
            let (c, _) = cp::backward(
                &Direct,
                &g.inputs,
                &opt,
                &g.d_o,
                Some(&g.dht),
                &PlanSpec::World(3),
                &CpOptions::default(),
            )
            .unwrap();
            (b.dx, b.dweight, b.dh0, c.dx, c.dweight)
        })
    };
    assert_eq!(run(1), run(3));
}
