//! GDN (FLA's gated delta rule): naive vs chunk vs CP vs intra-card in f64,
//! an independent scalar-gate recurrence (FLA's `naive_recurrent_gated_delta_rule`
//! written out), finite differences for every gradient, f32 vs f64, bad inputs.

use crate::common;

use common::{assert_close, assert_close_opt, check_grad, dot};
use deltaref::cp::PlanSpec;
use deltaref::cp::{self, CpOptions};
use deltaref::cp::{plan_spec, IntraParams};
use deltaref::error::Error;
use deltaref::gdn::{GdnGrads, GdnInputs, GdnOptions, GdnOutputs, OnKda};
use deltaref::inputs::{self, GdnSpec, Layout};
use deltaref::kda::{Chunk, Naive};
use deltaref::op;

const NAIVE: OnKda<Naive> = OnKda(Naive);
use ndarray::{s, Array2, Array4, ArrayD, Ix3, Ix4};

fn spec(layout: Layout, opts: GdnOptions, seed: u64) -> GdnSpec {
    GdnSpec {
        layout,
        h: 2,
        hv: 4,
        k: 5,
        v: 3,
        opts,
        initial_state: true,
        seed,
    }
}

/// The option sets every property runs over.
fn option_sets() -> Vec<GdnOptions> {
    let base = GdnOptions {
        output_final_state: true,
        ..GdnOptions::default()
    };
    vec![
        base,
        GdnOptions {
            use_gate_in_kernel: true,
            use_qk_l2norm_in_kernel: true,
            ..base
        },
        GdnOptions {
            use_beta_sigmoid_in_kernel: true,
            allow_neg_eigval: true,
            state_v_first: true,
            scale: Some(0.3),
            ..base
        },
        GdnOptions {
            use_gate_in_kernel: true,
            state_v_first: true,
            ..base
        },
    ]
}

fn assert_outputs(what: &str, r: &GdnOutputs<f64>, x: &GdnOutputs<f64>, tol: f64) {
    assert_close(&format!("{what} o"), &r.o, &x.o, tol);
    assert_close_opt(
        &format!("{what} final_state"),
        &r.final_state,
        &x.final_state,
        tol,
    );
}

fn assert_grads(what: &str, r: &GdnGrads<f64>, x: &GdnGrads<f64>, tol: f64) {
    for (n, a, b) in [
        ("dq", &r.dq, &x.dq),
        ("dk", &r.dk, &x.dk),
        ("dv", &r.dv, &x.dv),
        ("dg", &r.dg, &x.dg),
        ("dbeta", &r.dbeta, &x.dbeta),
    ] {
        assert_close(&format!("{what} {n}"), a, b, tol);
    }
    assert_close_opt(&format!("{what} dA_log"), &r.da_log, &x.da_log, tol);
    assert_close_opt(&format!("{what} ddt_bias"), &r.ddt_bias, &x.ddt_bias, tol);
    assert_close_opt(&format!("{what} dh0"), &r.dh0, &x.dh0, tol);
}

#[test]
fn naive_chunk_cp_and_intra_agree_in_f64() {
    let layout = Layout::varlen(&[37, 0, 1, 50, 20]);
    let cuts = PlanSpec::Cuts(vec![5, 38, 40, 70, 90]);
    let world = PlanSpec::World(3);
    let chunk = OnKda(Chunk::new(16).unwrap());
    let cp = CpOptions::default();
    for (i, opt) in option_sets().into_iter().enumerate() {
        let g = inputs::GdnSpec::generate(&spec(layout.clone(), opt, 10 + i as u64));
        let x = &g.inputs;
        let tag = format!("{opt:?}");
        let f_naive = op::forward(&NAIVE, x, &opt).unwrap();
        let f_chunk = op::forward(&chunk, x, &opt).unwrap();
        assert_outputs(&format!("chunk {tag}"), &f_naive, &f_chunk, 1e-10);
        let b_naive = op::backward(&NAIVE, x, &opt, &g.d_o, Some(&g.dht)).unwrap();
        let b_chunk = op::backward(&chunk, x, &opt, &g.d_o, Some(&g.dht)).unwrap();
        assert_grads(&format!("chunk {tag}"), &b_naive, &b_chunk, 1e-10);
        for plan in [&cuts, &world] {
            let (f, _) = cp::forward(&chunk, x, &opt, plan, &cp).unwrap();
            assert_outputs(&format!("cp {plan} {tag}"), &f_naive, &f, 1e-10);
            let (b, _) = cp::backward(&NAIVE, x, &opt, &g.d_o, Some(&g.dht), plan, &cp).unwrap();
            assert_grads(&format!("cp {plan} {tag}"), &b_naive, &b, 1e-10);
        }
        let intra = IntraParams {
            chunk_size: 16,
            subseq_len: Some(16),
            ..IntraParams::default()
        };
        let spec = plan_spec(x.cu_seqlens.as_ref().unwrap(), &intra).unwrap();
        assert!(
            matches!(&spec, PlanSpec::Cuts(c) if !c.is_empty()),
            "intra-card splits: {spec}"
        );
        let (f, _) = cp::forward(&chunk, x, &opt, &spec, &cp).unwrap();
        assert_outputs(&format!("intra-card {tag}"), &f_naive, &f, 1e-10);
    }
}

/// FLA's `naive_recurrent_gated_delta_rule`, one sequence and head at a time:
/// `h *= exp(g)`, `v' = (v − hᵀk)·β`, `h += k v'ᵀ`, `o = hᵀ(scale·q)`.
/// Plain inputs (no in-kernel options), state `[K, V]`.
fn direct_gdn(x: &GdnInputs<f64>, scale: f64) -> (Array4<f64>, Array4<f64>) {
    let q = x.q.view().into_dimensionality::<Ix4>().unwrap();
    let k = x.k.view().into_dimensionality::<Ix4>().unwrap();
    let v = x.v.view().into_dimensionality::<Ix4>().unwrap();
    let g = x.g.view().into_dimensionality::<Ix3>().unwrap();
    let beta = x.beta.view().into_dimensionality::<Ix3>().unwrap();
    let (b, t, h, kd) = q.dim();
    let (hv, vd) = (v.dim().2, v.dim().3);
    let mut o = Array4::zeros((b, t, hv, vd));
    let mut ht = Array4::zeros((b, hv, kd, vd));
    for bi in 0..b {
        for j in 0..hv {
            let hq = j / (hv / h);
            let mut st: Array2<f64> = match &x.initial_state {
                Some(s0) => s0
                    .slice(s![bi, j, .., ..])
                    .to_owned()
                    .into_dimensionality()
                    .unwrap(),
                None => Array2::zeros((kd, vd)),
            };
            for ti in 0..t {
                st *= g[[bi, ti, j]].exp();
                let kt = k.slice(s![bi, ti, hq, ..]);
                let vt = &v.slice(s![bi, ti, j, ..]) - &st.t().dot(&kt);
                let vt = vt * beta[[bi, ti, j]];
                for a in 0..kd {
                    for c in 0..vd {
                        st[[a, c]] += kt[a] * vt[c];
                    }
                }
                let qt = &q.slice(s![bi, ti, hq, ..]) * scale;
                o.slice_mut(s![bi, ti, j, ..]).assign(&st.t().dot(&qt));
            }
            ht.slice_mut(s![bi, j, .., ..]).assign(&st);
        }
    }
    (o, ht)
}

#[test]
fn matches_the_scalar_gate_recurrence() {
    let opt = GdnOptions {
        output_final_state: true,
        ..GdnOptions::default()
    };
    let g = inputs::GdnSpec::generate(&spec(Layout::batch(2, 23), opt, 3));
    let (o, ht) = direct_gdn(&g.inputs, 5f64.powf(-0.5));
    let f = op::forward(&OnKda(Chunk::new(16).unwrap()), &g.inputs, &opt).unwrap();
    assert_close("o", &o.into_dyn(), &f.o, 1e-12);
    assert_close(
        "final_state",
        &ht.into_dyn(),
        f.final_state.as_ref().unwrap(),
        1e-12,
    );
}

#[test]
fn state_v_first_is_the_transposed_layout() {
    let kv = GdnOptions {
        output_final_state: true,
        ..GdnOptions::default()
    };
    let vk = GdnOptions {
        state_v_first: true,
        ..kv
    };
    let g = inputs::GdnSpec::generate(&spec(Layout::varlen(&[9, 14]), kv, 4));
    let mut x = g.inputs.clone();
    x.initial_state = x.initial_state.map(|s| common::swap_state(&s));
    let a = op::forward(&NAIVE, &g.inputs, &kv).unwrap();
    let b = op::forward(&NAIVE, &x, &vk).unwrap();
    assert_eq!(a.o, b.o);
    assert_eq!(
        common::swap_state(a.final_state.as_ref().unwrap()),
        b.final_state.unwrap()
    );
    assert_ne!(
        a.final_state.unwrap().shape(),
        x.initial_state.as_ref().unwrap().shape()
    );
    // What validation hands a caller running GDN as KDA: the initial state
    // in [N,HV,K,V], swapped once from state_v_first, borrowed otherwise.
    let kv_h0 = g.inputs.initial_state.as_ref().unwrap();
    let (_, swapped) = vk.validate_refs_kv(&x.refs()).unwrap();
    let swapped = swapped.unwrap();
    assert!(matches!(swapped, std::borrow::Cow::Owned(_)));
    assert_eq!(&*swapped, kv_h0);
    let (_, borrowed) = kv.validate_refs_kv(&g.inputs.refs()).unwrap();
    let borrowed = borrowed.unwrap();
    assert!(matches!(borrowed, std::borrow::Cow::Borrowed(h) if std::ptr::eq(h, kv_h0)));
}

fn loss(x: &GdnInputs<f64>, opt: &GdnOptions, d_o: &ArrayD<f64>, dht: &ArrayD<f64>) -> f64 {
    let f = op::forward(&NAIVE, x, opt).unwrap();
    dot(&f.o, d_o) + dot(f.final_state.as_ref().unwrap(), dht)
}

#[test]
fn finite_differences_every_gradient() {
    for (i, opt) in option_sets().into_iter().enumerate() {
        let s = GdnSpec {
            k: 3,
            v: 2,
            ..spec(Layout::varlen(&[4, 0, 1, 6]), opt, 20 + i as u64)
        };
        let g = inputs::GdnSpec::generate(&s);
        let x = &g.inputs;
        let gr = op::backward(&NAIVE, x, &opt, &g.d_o, Some(&g.dht)).unwrap();
        let l = |x: GdnInputs<f64>| loss(&x, &opt, &g.d_o, &g.dht);
        let tag = |n: &str| format!("{n} ({opt:?})");
        check_grad(&tag("dq"), Some(&gr.dq), &x.q, |t| {
            l(GdnInputs {
                q: t.clone(),
                ..x.clone()
            })
        });
        check_grad(&tag("dk"), Some(&gr.dk), &x.k, |t| {
            l(GdnInputs {
                k: t.clone(),
                ..x.clone()
            })
        });
        check_grad(&tag("dv"), Some(&gr.dv), &x.v, |t| {
            l(GdnInputs {
                v: t.clone(),
                ..x.clone()
            })
        });
        check_grad(&tag("dg"), Some(&gr.dg), &x.g, |t| {
            l(GdnInputs {
                g: t.clone(),
                ..x.clone()
            })
        });
        check_grad(&tag("dbeta"), Some(&gr.dbeta), &x.beta, |t| {
            l(GdnInputs {
                beta: t.clone(),
                ..x.clone()
            })
        });
        let h0 = x.initial_state.as_ref().unwrap();
        check_grad(&tag("dh0"), gr.dh0.as_ref(), h0, |t| {
            l(GdnInputs {
                initial_state: Some(t.clone()),
                ..x.clone()
            })
        });
        if opt.use_gate_in_kernel {
            check_grad(
                &tag("dA_log"),
                gr.da_log.as_ref(),
                x.a_log.as_ref().unwrap(),
                |t| {
                    l(GdnInputs {
                        a_log: Some(t.clone()),
                        ..x.clone()
                    })
                },
            );
            check_grad(
                &tag("ddt_bias"),
                gr.ddt_bias.as_ref(),
                x.dt_bias.as_ref().unwrap(),
                |t| {
                    l(GdnInputs {
                        dt_bias: Some(t.clone()),
                        ..x.clone()
                    })
                },
            );
        } else {
            assert!(gr.da_log.is_none() && gr.ddt_bias.is_none());
        }
    }
}

#[test]
fn f32_close_to_f64() {
    for opt in option_sets() {
        let g = inputs::GdnSpec::generate(&spec(Layout::varlen(&[30, 41]), opt, 7));
        let chunk = OnKda(Chunk::new(16).unwrap());
        let f64_ = op::forward(&chunk, &g.inputs, &opt).unwrap();
        let x32 = g.inputs.cast::<f32>();
        let f32_ = op::forward(&chunk, &x32, &opt).unwrap();
        let up = |a: &ArrayD<f32>| a.mapv(f64::from);
        assert_close("f32 o", &f64_.o, &up(&f32_.o), 1e-5);
        let b64 = op::backward(&chunk, &g.inputs, &opt, &g.d_o, Some(&g.dht)).unwrap();
        let (do32, dht32) = (g.d_o.mapv(|v| v as f32), g.dht.mapv(|v| v as f32));
        let b32 = op::backward(&chunk, &x32, &opt, &do32, Some(&dht32)).unwrap();
        assert_close("f32 dg", &b64.dg, &up(&b32.dg), 1e-4);
        assert_close("f32 dq", &b64.dq, &up(&b32.dq), 1e-4);
    }
}

/// The forward's error for `x`, which must name `tensor`; the in-place
/// check a case file and the GPU go through (`GdnOptions::validate_refs`) must
/// give the same.
fn expect_err(x: &GdnInputs<f64>, opt: &GdnOptions, tensor: &str) -> Error {
    let e = op::forward(&NAIVE, x, opt).expect_err("must be refused");
    let msg = e.to_string();
    let in_place = opt
        .validate_refs(&x.refs())
        .expect_err("validate_refs must refuse it");
    assert_eq!(in_place.to_string(), msg, "`{tensor}`: in place vs prepare");
    assert!(
        msg.contains(tensor),
        "error for `{tensor}` does not name it: {msg}"
    );
    e
}

#[test]
fn bad_inputs_are_refused_with_the_tensor_named() {
    let opt = GdnOptions::default();
    let gate = GdnOptions {
        use_gate_in_kernel: true,
        ..opt
    };
    let g = inputs::GdnSpec::generate(&spec(Layout::varlen(&[3, 4]), gate, 1)).inputs;
    // A per-key gate is KDA, not GDN.
    let mut x = g.clone();
    x.g = ArrayD::zeros(vec![1, 7, 4, 5]);
    assert!(matches!(expect_err(&x, &opt, "g"), Error::Shape { .. }));
    let mut x = g.clone();
    x.a_log = None;
    assert!(matches!(
        expect_err(&x, &gate, "A_log"),
        Error::Missing { .. }
    ));
    let mut x = g.clone();
    x.dt_bias = Some(ArrayD::zeros(vec![4 * 5]));
    assert!(matches!(
        expect_err(&x, &gate, "dt_bias"),
        Error::Shape { .. }
    ));
    // A_log without the in-kernel gate would be silently ignored.
    assert!(matches!(
        expect_err(&g, &opt, "use_gate_in_kernel"),
        Error::Option { .. }
    ));
    let mut x = g.clone();
    x.g[[0, 2, 1]] = f64::NAN;
    assert!(matches!(
        expect_err(&x, &gate, "g"),
        Error::NonFinite { .. }
    ));
    let mut x = g.clone();
    x.a_log.as_mut().unwrap()[[0]] = f64::INFINITY;
    assert!(matches!(
        expect_err(&x, &gate, "A_log"),
        Error::NonFinite { .. }
    ));
    // Finite parameters whose decay −exp(A_log)·softplus(g + dt_bias) is not.
    let mut x = g.clone();
    x.a_log.as_mut().unwrap()[[1]] = 800.0;
    assert!(matches!(
        expect_err(&x, &gate, "g"),
        Error::NonFinite { .. }
    ));
    // What KDA's validation sees on the decay form.
    let mut x = g.clone();
    x.q[[0, 5, 1, 2]] = f64::NAN;
    assert!(matches!(
        expect_err(&x, &gate, "q"),
        Error::NonFinite { .. }
    ));
    let mut x = g.clone();
    x.k = ArrayD::zeros(vec![1, 7, 2, 4]);
    assert!(matches!(expect_err(&x, &gate, "k"), Error::Shape { .. }));
    let mut x = g.clone();
    x.beta = ArrayD::zeros(vec![1, 7, 2]);
    assert!(matches!(expect_err(&x, &gate, "beta"), Error::Shape { .. }));
    let mut x = g.clone();
    x.initial_state.as_mut().unwrap()[[1, 3, 4, 2]] = f64::NEG_INFINITY;
    assert!(matches!(
        expect_err(&x, &gate, "initial_state"),
        Error::NonFinite { .. }
    ));
    // state_v_first: [N,HV,V,K]; the [K,V] layout is refused (K ≠ V here).
    let vfirst = GdnOptions {
        state_v_first: true,
        ..gate
    };
    let mut x = g.clone();
    x.initial_state = Some(ArrayD::zeros(vec![2, 4, 5, 3]));
    assert!(matches!(
        expect_err(&x, &vfirst, "initial_state"),
        Error::Shape { .. }
    ));
    x.initial_state = Some(ArrayD::zeros(vec![2, 4, 3, 5]));
    op::forward(&NAIVE, &x, &vfirst).expect("the V-first layout is accepted");
    let e = op::backward(
        &NAIVE,
        &x,
        &vfirst,
        &ArrayD::zeros(vec![1, 7, 4, 3]),
        Some(&ArrayD::zeros(vec![2, 4])),
    )
    .expect_err("dht of the wrong rank");
    assert!(e.to_string().contains("dht"), "{e}");
    // The in-place upstream check refuses it the same way, and a NaN in `do`.
    let d = vfirst.validate_refs(&x.refs()).expect("valid inputs");
    let d_o = ArrayD::zeros(vec![1, 7, 4, 3]);
    let in_place = vfirst
        .validate_upstream(&d, &d_o, Some(&ArrayD::zeros(vec![2, 4])))
        .expect_err("dht of the wrong rank");
    assert_eq!(in_place.to_string(), e.to_string());
    let mut bad = d_o.clone();
    bad[[0, 6, 3, 2]] = f64::NAN;
    let e = vfirst
        .validate_upstream(&d, &bad, None)
        .expect_err("NaN in do");
    assert!(matches!(e, Error::NonFinite { .. }), "{e}");
    assert!(e.to_string().contains("`do`"), "{e}");
}

#[test]
fn bit_identical_for_any_thread_count() {
    let opt = option_sets()[1];
    let g = inputs::GdnSpec::generate(&spec(Layout::varlen(&[33, 2, 40]), opt, 8));
    let chunk = OnKda(Chunk::new(16).unwrap());
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let b = op::backward(&chunk, &g.inputs, &opt, &g.d_o, Some(&g.dht)).unwrap();
            let (c, _) = cp::backward(
                &chunk,
                &g.inputs,
                &opt,
                &g.d_o,
                Some(&g.dht),
                &PlanSpec::World(3),
                &CpOptions::default(),
            )
            .unwrap();
            (b.dq, b.dg, b.da_log, c.dk, c.dh0)
        })
    };
    assert_eq!(run(1), run(3));
}
