//! GDN-2 (FLA's `chunk_gdn2`, issue 51) in f64: naive = chunk (C = 16, 32,
//! 64) = CP (contiguous, zigzag, arbitrary cuts) on random problems; central
//! finite differences of every gradient; `b = w = β` is KDA; the DPLR form
//! of the same recurrence; f32 against f64; thread-count invariance; bad
//! inputs refused with the tensor named.

use crate::common;

use common::{assert_close, check_grad, dot, norm_ratio};
use deltaref::cp::PlanSpec;
use deltaref::cp::{self, CpOptions};
use deltaref::dplr::{self, DplrInputs, DplrOptions};
use deltaref::error::Error;
use deltaref::gates::Gate;
use deltaref::gdn2::{Chunk, Gdn2, Gdn2Grads, Gdn2Inputs, Gdn2Options, Gdn2Outputs, Naive};
use deltaref::inputs::Layout;
use deltaref::kda::{self, KdaInputs, KdaOptions};
use deltaref::op::{self, Engine, Operator};
use deltaref::rng::Stream;
use ndarray::{s, Array, ArrayD, Axis, Ix4, IxDyn};
use proptest::prelude::*;

/// One problem: inputs, options and the upstream gradients `do`, `dht`.
#[derive(Clone, Debug)]
struct Case {
    x: Gdn2Inputs<f64>,
    opt: Gdn2Options,
    d_o: ArrayD<f64>,
    dht: ArrayD<f64>,
}

/// Which in-kernel gate a case uses.
#[derive(Clone, Copy, Debug, PartialEq)]
enum GateKind {
    /// `g` is the decay.
    None,
    /// `−exp(A_log)·softplus(g + dt_bias)`.
    Softplus,
    /// `lower_bound·sigmoid(exp(A_log)·(g + dt_bias))`, or without `A_log`.
    LowerBound { a_log: bool },
    /// The bounded gate under `safe_gate`.
    Safe,
}

/// The shape and options of a generated case.
#[derive(Clone, Debug)]
struct Spec {
    layout: Layout,
    h: usize,
    k: usize,
    v: usize,
    gate: GateKind,
    dt_bias: bool,
    l2norm: bool,
    state_v_first: bool,
    scale: Option<f64>,
    initial_state: bool,
    seed: u64,
}

impl Spec {
    fn new(layout: Layout, seed: u64) -> Self {
        Spec {
            layout,
            h: 2,
            k: 4,
            v: 3,
            gate: GateKind::None,
            dt_bias: false,
            l2norm: false,
            state_v_first: false,
            scale: None,
            initial_state: true,
            seed,
        }
    }
}

fn tensor(
    seed: u64,
    name: &str,
    shape: &[usize],
    f: impl Fn(usize, f64, f64) -> f64,
) -> ArrayD<f64> {
    let s = Stream::new(seed, name);
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| f(i, s.normal(i as u64), s.uniform(i as u64, 15)))
        .collect();
    Array::from_shape_vec(IxDyn(shape), v).expect("size")
}

/// Random inputs whose recurrence neither explodes nor forgets at once:
/// keys of norm 0.6–1.1 and erase gates in [0, 1.5] keep `1 − Σ b k²` in
/// (−1, 1]; decays from −1e-3 (long memory, so CP's merge matters) to −0.8.
fn case(s: &Spec) -> Case {
    let (b, t, h, k, v) = (s.layout.b, s.layout.t, s.h, s.k, s.v);
    let seed = s.seed;
    let qk = [b, t, h, k];
    let mut keys = tensor(seed, "k", &qk, |_, n, _| n);
    let norms = tensor(seed, "k_norm", &[b, t, h], |_, _, u| 0.6 + 0.5 * u);
    for (mut row, nrm) in keys.lanes_mut(Axis(3)).into_iter().zip(norms.iter()) {
        let len = row.dot(&row).sqrt().max(1e-3);
        row.mapv_inplace(|e| e / len * nrm);
    }
    let gated = s.gate != GateKind::None;
    let g = tensor(
        seed,
        "g",
        &qk,
        |_, n, u| {
            if gated {
                n
            } else {
                -(1e-3 + 0.8 * u)
            }
        },
    );
    let lower_bound = match s.gate {
        GateKind::LowerBound { .. } => Some(-0.5 - 4.0 * Stream::new(seed, "lb").uniform(0, 0)),
        GateKind::Safe => Some(-5.0),
        _ => None,
    };
    let a_log = match s.gate {
        GateKind::Softplus | GateKind::Safe | GateKind::LowerBound { a_log: true } => {
            Some(tensor(seed, "A_log", &[h], |_, _, u| {
                (1.0 + 3.0 * u).ln() - 1.0
            }))
        }
        _ => None,
    };
    let n = s.layout.n();
    let state = if s.state_v_first {
        [n, h, v, k]
    } else {
        [n, h, k, v]
    };
    let x = Gdn2Inputs {
        q: tensor(seed, "q", &qk, |_, n, _| n),
        k: keys,
        v: tensor(seed, "v", &[b, t, h, v], |_, n, _| n),
        g,
        b: tensor(seed, "b", &qk, |_, _, u| 1.5 * u),
        w: tensor(seed, "w", &[b, t, h, v], |_, _, u| u),
        a_log,
        dt_bias: (gated && s.dt_bias).then(|| tensor(seed, "dt_bias", &[h * k], |_, n, _| 0.5 * n)),
        initial_state: s
            .initial_state
            .then(|| tensor(seed, "h0", &state, |_, n, _| n)),
        cu_seqlens: s.layout.cu_seqlens(),
    };
    let opt = Gdn2Options {
        scale: s.scale,
        output_final_state: true,
        use_qk_l2norm_in_kernel: s.l2norm,
        use_gate_in_kernel: gated,
        safe_gate: s.gate == GateKind::Safe,
        lower_bound,
        state_v_first: s.state_v_first,
    };
    Case {
        x,
        opt,
        d_o: tensor(seed, "do", &[b, t, h, v], |_, n, _| n),
        dht: tensor(seed, "dht", &state, |_, n, _| n),
    }
}

/// norm_ratio ≤ 1e-10, or (a reference that is all but zero, where the
/// ratio's 1e-8 floor dominates) max_abs ≤ 1e-12.
fn close(what: &str, a: &ArrayD<f64>, b: &ArrayD<f64>) -> Result<(), TestCaseError> {
    within(what, a, b, 1e-10)
}

/// norm_ratio ≤ `tol`, or max_abs ≤ 1e-12: a gradient that is zero in
/// exact arithmetic (the decay's, with a zero state) comes out as rounding
/// noise of its cancelling terms, whose norm_ratio means nothing.
fn within(what: &str, a: &ArrayD<f64>, b: &ArrayD<f64>, tol: f64) -> Result<(), TestCaseError> {
    let r = norm_ratio(a, b);
    let m = a
        .iter()
        .zip(b.iter())
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    prop_assert!(
        r <= tol || m <= 1e-12,
        "{}: norm_ratio {:e}, max_abs {:e}",
        what,
        r,
        m
    );
    Ok(())
}

fn close_opt(
    what: &str,
    a: &Option<ArrayD<f64>>,
    b: &Option<ArrayD<f64>>,
) -> Result<(), TestCaseError> {
    match (a, b) {
        (Some(a), Some(b)) => close(what, a, b),
        (None, None) => Ok(()),
        _ => Err(TestCaseError::fail(format!(
            "{what}: present in one result only"
        ))),
    }
}

fn outputs_close(
    what: &str,
    r: &Gdn2Outputs<f64>,
    x: &Gdn2Outputs<f64>,
) -> Result<(), TestCaseError> {
    close(&format!("{what} o"), &r.o, &x.o)?;
    close_opt(
        &format!("{what} final_state"),
        &r.final_state,
        &x.final_state,
    )
}

fn grads_close(what: &str, r: &Gdn2Grads<f64>, x: &Gdn2Grads<f64>) -> Result<(), TestCaseError> {
    for (n, a, b) in [
        ("dq", &r.dq, &x.dq),
        ("dk", &r.dk, &x.dk),
        ("dv", &r.dv, &x.dv),
        ("dg", &r.dg, &x.dg),
        ("db", &r.db, &x.db),
        ("dw", &r.dw, &x.dw),
    ] {
        close(&format!("{what} {n}"), a, b)?;
    }
    close_opt(&format!("{what} dA_log"), &r.da_log, &x.da_log)?;
    close_opt(&format!("{what} ddt_bias"), &r.ddt_bias, &x.ddt_bias)?;
    close_opt(&format!("{what} dh0"), &r.dh0, &x.dh0)
}

/// Lengths (some 0 or 1), at least one token in all.
fn lengths() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(prop_oneof![Just(0usize), Just(1usize), 2usize..100], 1..5)
        .prop_filter("at least one token", |l| l.iter().sum::<usize>() >= 1)
}

/// World sizes 1..=8 that split `t` tokens evenly.
fn divisors(t: usize) -> Vec<usize> {
    (1..=8).filter(|&w| t.is_multiple_of(w)).collect()
}

/// A layout (varlen, or one unpacked sequence) and a CP plan: FLA's
/// contiguous split, its zigzag layout where `2W | T`, or arbitrary cuts.
fn layout_and_plan() -> impl Strategy<Value = (Layout, PlanSpec)> {
    (lengths(), any::<bool>(), 0u8..3).prop_flat_map(|(lengths, varlen, kind)| {
        let t: usize = lengths.iter().sum();
        let layout = if varlen {
            Layout::varlen(&lengths)
        } else {
            Layout::batch(1, t)
        };
        let zigzag: Vec<usize> = (1..=4).filter(|&w| t.is_multiple_of(2 * w)).collect();
        let plan = if kind == 0 && !zigzag.is_empty() {
            prop::sample::select(zigzag)
                .prop_map(PlanSpec::Zigzag)
                .boxed()
        } else if kind < 2 {
            prop::sample::select(divisors(t))
                .prop_map(PlanSpec::World)
                .boxed()
        } else if t == 1 {
            Just(PlanSpec::Cuts(vec![])).boxed()
        } else {
            prop::collection::btree_set(1..t, 0..=(t - 1).min(7))
                .prop_map(|s| PlanSpec::Cuts(s.into_iter().collect()))
                .boxed()
        };
        (Just(layout), plan)
    })
}

fn gate_kind() -> impl Strategy<Value = GateKind> {
    prop_oneof![
        Just(GateKind::None),
        Just(GateKind::Softplus),
        Just(GateKind::LowerBound { a_log: true }),
        Just(GateKind::LowerBound { a_log: false }),
        Just(GateKind::Safe),
    ]
}

fn spec() -> impl Strategy<Value = (Spec, PlanSpec)> {
    (
        layout_and_plan(),
        (1usize..3, 1usize..5, 1usize..4),
        gate_kind(),
        any::<[bool; 4]>(),
        prop::option::of(0.1f64..1.5),
        0u64..1000,
    )
        .prop_map(|((layout, plan), (h, k, v), gate, flags, scale, seed)| {
            let [dt_bias, l2norm, state_v_first, initial_state] = flags;
            let s = Spec {
                layout,
                h,
                k,
                v,
                gate,
                dt_bias,
                l2norm,
                state_v_first,
                scale,
                initial_state,
                seed,
            };
            (s, plan)
        })
}

fn fwd<E: Engine<f64, Op = Gdn2>>(e: &E, c: &Case) -> Gdn2Outputs<f64> {
    op::forward(e, &c.x, &c.opt).expect("valid")
}

fn bwd<E: Engine<f64, Op = Gdn2>>(e: &E, c: &Case) -> Gdn2Grads<f64> {
    op::backward(e, &c.x, &c.opt, &c.d_o, Some(&c.dht)).expect("valid")
}

proptest! {
    #![proptest_config(common::proptest_config(128))]

    /// Naive = chunk (16, 32, 64) = CP (naive and chunked) in f64.
    #[test]
    fn naive_chunk_and_cp_agree((s, plan) in spec(), cs in prop::sample::select(vec![16usize, 32, 64])) {
        let c = case(&s);
        let (f, b) = (fwd(&Naive, &c), bwd(&Naive, &c));
        prop_assert!(f.final_state.is_some());
        prop_assert_eq!(b.dh0.is_some(), s.initial_state);
        for size in [16, 32, 64] {
            let chunk = Chunk::new(size).unwrap();
            outputs_close(&format!("chunk {size}"), &f, &fwd(&chunk, &c))?;
            grads_close(&format!("chunk {size}"), &b, &bwd(&chunk, &c))?;
        }
        let cpo = CpOptions::default();
        let chunk = Chunk::new(cs).unwrap();
        let (o, _) = cp::forward(&chunk, &c.x, &c.opt, &plan, &cpo).unwrap();
        outputs_close(&format!("cp chunk {cs} {plan}"), &f, &o)?;
        let (g, _) = cp::backward(&chunk, &c.x, &c.opt, &c.d_o, Some(&c.dht), &plan, &cpo).unwrap();
        grads_close(&format!("cp chunk {cs} {plan}"), &b, &g)?;
        let (o, g, _) = cp::forward_backward(&Naive, &c.x, &c.opt, &c.d_o, Some(&c.dht), &plan, &cpo).unwrap();
        outputs_close(&format!("cp naive {plan}"), &f, &o)?;
        grads_close(&format!("cp naive {plan}"), &b, &g)?;
    }

    /// `b = β` over K and `w = β` over V is KDA, outputs and gradients
    /// (`dbeta = Σ_K db + Σ_V dw`), with matching options.
    #[test]
    fn b_equal_w_equal_beta_is_kda(
        lengths in lengths(), h in 1usize..3, k in 1usize..5, v in 1usize..4,
        gate in gate_kind(), flags in any::<[bool; 3]>(), seed in 0u64..1000,
    ) {
        let [dt_bias, l2norm, h0] = flags;
        let s = Spec { h, k, v, gate, dt_bias, l2norm, initial_state: h0, ..Spec::new(Layout::varlen(&lengths), seed) };
        let mut c = case(&s);
        let (bt, t) = (c.x.q.shape()[0], c.x.q.shape()[1]);
        let beta = c.x.b.slice(s![.., .., .., 0]).to_owned();
        let spread = |width: usize| {
            beta.view().insert_axis(Axis(3)).broadcast((bt, t, h, width)).unwrap().to_owned().into_dyn()
        };
        c.x.b = spread(k);
        c.x.w = spread(v);
        let kx = KdaInputs {
            q: c.x.q.clone(), k: c.x.k.clone(), v: c.x.v.clone(), g: c.x.g.clone(),
            beta: beta.into_dyn(), a_log: c.x.a_log.clone(), dt_bias: c.x.dt_bias.clone(),
            initial_state: c.x.initial_state.clone(), cu_seqlens: c.x.cu_seqlens.clone(),
        };
        let kopt = KdaOptions {
            scale: c.opt.scale,
            output_final_state: true,
            use_qk_l2norm_in_kernel: c.opt.use_qk_l2norm_in_kernel,
            gate: match (c.opt.use_gate_in_kernel, c.opt.lower_bound) {
                (false, _) => Gate::None,
                (true, None) => Gate::Kda,
                (true, Some(lower_bound)) => Gate::LowerBound { lower_bound },
            },
            ..KdaOptions::default()
        };
        let tol = 1e-12;
        let chunk = Chunk::new(16).unwrap();
        let ours = [(fwd(&Naive, &c), bwd(&Naive, &c)), (fwd(&chunk, &c), bwd(&chunk, &c))];
        let (kn, kc) = (kda::Naive, kda::Chunk::new(16).unwrap());
        let theirs = [
            (op::forward(&kn, &kx, &kopt).unwrap(), op::backward(&kn, &kx, &kopt, &c.d_o, Some(&c.dht)).unwrap()),
            (op::forward(&kc, &kx, &kopt).unwrap(), op::backward(&kc, &kx, &kopt, &c.d_o, Some(&c.dht)).unwrap()),
        ];
        for ((f, g), (kf, kg)) in ours.into_iter().zip(theirs) {
            within("o", &kf.o, &f.o, tol)?;
            within("final_state", kf.final_state.as_ref().unwrap(), f.final_state.as_ref().unwrap(), tol)?;
            for (n, a, b) in [("dq", &kg.dq, &g.dq), ("dk", &kg.dk, &g.dk), ("dv", &kg.dv, &g.dv), ("dg", &kg.dg, &g.dg)] {
                within(n, a, b, tol)?;
            }
            let dbeta = g.db.sum_axis(Axis(3)) + g.dw.sum_axis(Axis(3));
            within("dbeta", &kg.dbeta, &dbeta, tol)?;
            for (n, a, b) in [("dA_log", &kg.da_log, &g.da_log), ("ddt_bias", &kg.ddt_bias, &g.ddt_bias), ("dh0", &kg.dh0, &g.dh0)] {
                prop_assert_eq!(a.is_some(), b.is_some(), "{}", n);
                if let (Some(a), Some(b)) = (a, b) {
                    within(n, a, b, tol)?;
                }
            }
        }
    }

    /// GDN-2 is DPLR with `a = −(b ⊙ k ⊙ exp g)`, `b_dplr = k`, `k_dplr = k`,
    /// `v_dplr = w ⊙ v`, `gk = g`: `(I − k (b⊙k)ᵀ) D S = D S + k aᵀ S` with
    /// DPLR's `aᵀ S` reading the undecayed state. Outputs, and the
    /// gradients mapped back through that change of variables.
    #[test]
    fn is_dplr_with_a_decayed_erase_key(
        lengths in lengths(), h in 1usize..3, k in 1usize..5, v in 1usize..4,
        scale in prop::option::of(0.1f64..1.5), h0 in any::<bool>(), seed in 0u64..1000,
    ) {
        let s = Spec { h, k, v, scale, initial_state: h0, ..Spec::new(Layout::varlen(&lengths), seed) };
        let c = case(&s);
        let x = &c.x;
        let eg = x.g.mapv(f64::exp);
        let a = -(&x.b * &x.k * &eg);
        let dx = DplrInputs {
            q: x.q.clone(), k: x.k.clone(), v: &x.w * &x.v, a: a.clone(), b: x.k.clone(), gk: x.g.clone(),
            initial_state: x.initial_state.clone(), cu_seqlens: x.cu_seqlens.clone(),
        };
        let dopt = DplrOptions { scale: c.opt.scale, output_final_state: true, ..Default::default() };
        let tol = 1e-12;
        let (f, g) = (fwd(&Naive, &c), bwd(&Naive, &c));
        let chunk = dplr::Chunk::new(32).unwrap();
        let engines: [&dyn DplrRun; 2] = [&dplr::Naive, &chunk];
        for e in engines {
            let (df, dg) = e.run(&dx, &dopt, &c);
            within("o", &df.o, &f.o, tol)?;
            within("final_state", df.final_state.as_ref().unwrap(), f.final_state.as_ref().unwrap(), tol)?;
            // a = −b⊙k⊙e^g: ∂a/∂b = −k⊙e^g, ∂a/∂k = −b⊙e^g, ∂a/∂g = a.
            let mapped = [
                ("dq", dg.dq.clone(), &g.dq),
                ("dk", &dg.dk + &dg.db - &(&dg.da * &x.b * &eg), &g.dk),
                ("dv", &dg.dv * &x.w, &g.dv),
                ("dw", &dg.dv * &x.v, &g.dw),
                ("db", -(&dg.da * &x.k * &eg), &g.db),
                ("dg", &dg.dgk + &(&dg.da * &a), &g.dg),
            ];
            for (n, want, got) in mapped {
                within(n, &want, got, 1e-11)?;
            }
            prop_assert_eq!(dg.dh0.is_some(), g.dh0.is_some());
            if let (Some(p), Some(q)) = (&dg.dh0, &g.dh0) {
                within("dh0", p, q, 1e-11)?;
            }
        }
    }
}

/// A DPLR engine run forward and backward on a GDN-2 case's upstream gradients.
trait DplrRun {
    fn run(
        &self,
        x: &DplrInputs<f64>,
        opt: &DplrOptions,
        c: &Case,
    ) -> (dplr::DplrOutputs<f64>, dplr::DplrGrads<f64>);
}

impl<E: Engine<f64, Op = dplr::Dplr>> DplrRun for E {
    fn run(
        &self,
        x: &DplrInputs<f64>,
        opt: &DplrOptions,
        c: &Case,
    ) -> (dplr::DplrOutputs<f64>, dplr::DplrGrads<f64>) {
        (
            op::forward(self, x, opt).unwrap(),
            op::backward(self, x, opt, &c.d_o, Some(&c.dht)).unwrap(),
        )
    }
}

/// Option sets the deterministic tests run over: every gate form, with and
/// without its optional parameters, l2norm, `state_v_first`, `scale`.
fn specs(layout: Layout, seed: u64) -> Vec<Spec> {
    let base = Spec::new(layout, seed);
    vec![
        Spec {
            scale: Some(0.7),
            ..base.clone()
        },
        Spec {
            gate: GateKind::Softplus,
            dt_bias: true,
            l2norm: true,
            ..base.clone()
        },
        Spec {
            gate: GateKind::Softplus,
            state_v_first: true,
            ..base.clone()
        },
        Spec {
            gate: GateKind::LowerBound { a_log: true },
            dt_bias: true,
            l2norm: true,
            ..base.clone()
        },
        Spec {
            gate: GateKind::LowerBound { a_log: false },
            dt_bias: true,
            state_v_first: true,
            ..base.clone()
        },
        Spec {
            gate: GateKind::Safe,
            l2norm: true,
            ..base
        },
    ]
}

fn loss(x: &Gdn2Inputs<f64>, c: &Case) -> f64 {
    let f = op::forward(&Naive, x, &c.opt).unwrap();
    dot(&f.o, &c.d_o) + dot(f.final_state.as_ref().unwrap(), &c.dht)
}

/// Every gradient against central differences of the loss, element by element.
#[test]
fn finite_differences_every_gradient() {
    for (i, s) in specs(Layout::varlen(&[4, 0, 1, 6]), 20)
        .into_iter()
        .enumerate()
    {
        let s = Spec {
            k: 3,
            v: 2,
            seed: 20 + i as u64,
            ..s
        };
        let c = case(&s);
        let x = &c.x;
        let gr = bwd(&Naive, &c);
        let tag = |n: &str| format!("{n} ({s:?})");
        type Field = fn(&mut Gdn2Inputs<f64>) -> &mut ArrayD<f64>;
        let fields: [(&str, Field, &ArrayD<f64>); 6] = [
            ("dq", |x| &mut x.q, &gr.dq),
            ("dk", |x| &mut x.k, &gr.dk),
            ("dv", |x| &mut x.v, &gr.dv),
            ("dg", |x| &mut x.g, &gr.dg),
            ("db", |x| &mut x.b, &gr.db),
            ("dw", |x| &mut x.w, &gr.dw),
        ];
        for (name, field, analytic) in fields {
            let mut y = x.clone();
            let at = field(&mut y).clone();
            check_grad(&tag(name), Some(analytic), &at, |t| {
                let mut y = x.clone();
                *field(&mut y) = t.clone();
                loss(&y, &c)
            });
        }
        type OptField = fn(&mut Gdn2Inputs<f64>) -> &mut Option<ArrayD<f64>>;
        let optional: [(&str, OptField, &Option<ArrayD<f64>>); 3] = [
            ("dA_log", |x| &mut x.a_log, &gr.da_log),
            ("ddt_bias", |x| &mut x.dt_bias, &gr.ddt_bias),
            ("dh0", |x| &mut x.initial_state, &gr.dh0),
        ];
        for (name, field, analytic) in optional {
            let mut y = x.clone();
            let Some(at) = field(&mut y).clone() else {
                assert!(
                    analytic.is_none(),
                    "{}: a gradient without its input",
                    tag(name)
                );
                continue;
            };
            check_grad(&tag(name), analytic.as_ref(), &at, |t| {
                let mut y = x.clone();
                *field(&mut y) = Some(t.clone());
                loss(&y, &c)
            });
        }
    }
}

/// FLA's softplus is `x` above 20: the decay there is `−exp(A_log)·x`.
#[test]
fn softplus_is_the_identity_above_fla_threshold() {
    let s = Spec {
        gate: GateKind::Softplus,
        ..Spec::new(Layout::batch(1, 5), 3)
    };
    let mut c = case(&s);
    c.x.g.mapv_inplace(|e| 20.5 + e.abs());
    let a = c.x.a_log.clone().unwrap();
    let mut plain = c.clone();
    for ((_, _, h, _), e) in tensor_view4(&mut plain.x.g).indexed_iter_mut() {
        *e *= -a[[h]].exp();
    }
    plain.x.a_log = None;
    plain.opt.use_gate_in_kernel = false;
    assert_eq!(fwd(&Naive, &c).o, fwd(&Naive, &plain).o);
    let (gated, direct) = (bwd(&Naive, &c), bwd(&Naive, &plain));
    // d/dx of −exp(A_log)·x.
    let mut want = direct.dg.clone();
    for ((_, _, h, _), e) in tensor_view4(&mut want).indexed_iter_mut() {
        *e *= -a[[h]].exp();
    }
    assert_close("dg", &want, &gated.dg, 1e-15);
}

fn tensor_view4(a: &mut ArrayD<f64>) -> ndarray::ArrayViewMut4<'_, f64> {
    a.view_mut().into_dimensionality::<Ix4>().unwrap()
}

/// `state_v_first` transposes the state tensors and nothing else.
#[test]
fn state_v_first_is_the_transposed_layout() {
    let s = Spec {
        k: 5,
        v: 3,
        ..Spec::new(Layout::varlen(&[9, 0, 14]), 4)
    };
    let c = case(&s);
    let mut t = c.clone();
    t.opt.state_v_first = true;
    t.x.initial_state = c.x.initial_state.as_ref().map(common::swap_state);
    t.dht = common::swap_state(&c.dht);
    let (a, b) = (fwd(&Naive, &c), fwd(&Naive, &t));
    assert_eq!(a.o, b.o);
    assert_eq!(
        common::swap_state(a.final_state.as_ref().unwrap()),
        b.final_state.unwrap()
    );
    let (ga, gb) = (bwd(&Naive, &c), bwd(&Naive, &t));
    assert_eq!(ga.dq, gb.dq);
    assert_eq!(
        common::swap_state(ga.dh0.as_ref().unwrap()),
        gb.dh0.unwrap()
    );
}

/// The chunked engine's CP transition (FLA's product of chunk transitions
/// `Diag(exp Γ_last) − kgᵀ w_wy`) is the probe run's.
#[test]
fn chunk_transition_is_the_state_map() {
    let s = Spec {
        k: 5,
        ..Spec::new(Layout::batch(1, 75), 5)
    };
    let c = case(&s);
    let p = <Gdn2 as Operator<f64>>::prepare(&c.x, &c.opt).unwrap();
    let seg = p.segments[0];
    let head = <Gdn2 as Operator<f64>>::head(&p, &seg, 1);
    for size in [16, 32, 64] {
        let chunk = Chunk::new(size).unwrap();
        let m = chunk.transition(&head);
        let (probe, kd) = <Gdn2 as Operator<f64>>::probe(&head);
        let by_probe = Naive.forward(&probe, ndarray::Array2::eye(kd).view()).1;
        assert_close(
            &format!("M (C = {size})"),
            &by_probe.into_dyn(),
            &m.into_dyn(),
            1e-12,
        );
    }
}

/// f32 engines stay close to f64.
#[test]
fn f32_close_to_f64() {
    for s in specs(Layout::varlen(&[30, 1, 41]), 7) {
        let c = case(&s);
        let x32 = c.x.cast::<f32>();
        let (do32, dht32) = (c.d_o.mapv(|e| e as f32), c.dht.mapv(|e| e as f32));
        let up = |a: &ArrayD<f32>| a.mapv(f64::from);
        let check = |what: &str,
                     f64_: (Gdn2Outputs<f64>, Gdn2Grads<f64>),
                     f32_: (Gdn2Outputs<f32>, Gdn2Grads<f32>)| {
            assert_close(&format!("{what} o"), &f64_.0.o, &up(&f32_.0.o), 1e-5);
            assert_close(
                &format!("{what} final_state"),
                f64_.0.final_state.as_ref().unwrap(),
                &up(f32_.0.final_state.as_ref().unwrap()),
                1e-5,
            );
            for (n, a, b) in [
                ("dq", &f64_.1.dq, &f32_.1.dq),
                ("dk", &f64_.1.dk, &f32_.1.dk),
                ("dg", &f64_.1.dg, &f32_.1.dg),
                ("db", &f64_.1.db, &f32_.1.db),
                ("dw", &f64_.1.dw, &f32_.1.dw),
            ] {
                assert_close(&format!("{what} {n}"), a, &up(b), 1e-4);
            }
        };
        let naive64 = (fwd(&Naive, &c), bwd(&Naive, &c));
        let naive32 = (
            op::forward(&Naive, &x32, &c.opt).unwrap(),
            op::backward(&Naive, &x32, &c.opt, &do32, Some(&dht32)).unwrap(),
        );
        check(&format!("naive {s:?}"), naive64, naive32);
        let chunk = Chunk::new(16).unwrap();
        let chunk64 = (fwd(&chunk, &c), bwd(&chunk, &c));
        let chunk32 = (
            op::forward(&chunk, &x32, &c.opt).unwrap(),
            op::backward(&chunk, &x32, &c.opt, &do32, Some(&dht32)).unwrap(),
        );
        check(&format!("chunk {s:?}"), chunk64, chunk32);
    }
}

fn bits(g: &Gdn2Grads<f64>, o: &Gdn2Outputs<f64>) -> Vec<u64> {
    let mut all = vec![
        &o.o,
        o.final_state.as_ref().unwrap(),
        &g.dq,
        &g.dk,
        &g.dv,
        &g.dg,
        &g.db,
        &g.dw,
    ];
    all.extend(g.da_log.iter().chain(&g.ddt_bias).chain(&g.dh0));
    all.into_iter()
        .flat_map(|t| t.iter().map(|v| v.to_bits()))
        .collect()
}

/// `op::forward_backward` (every pair's results written in place) gives
/// the bits of `op::forward` then `op::backward` on every head: with two
/// heads it once ran head 0 alone (one gradient slot per sequence, not per
/// pair), leaving head 1's outputs zero.
#[test]
fn forward_backward_runs_every_head() {
    let s = Spec {
        gate: GateKind::Softplus,
        dt_bias: true,
        ..Spec::new(Layout::varlen(&[9, 0, 14]), 5)
    };
    assert_eq!(s.h, 2);
    let c = case(&s);
    for (f, b, (f2, b2)) in [
        (
            fwd(&Naive, &c),
            bwd(&Naive, &c),
            op::forward_backward(&Naive, &c.x, &c.opt, &c.d_o, Some(&c.dht)).unwrap(),
        ),
        (
            fwd(&Chunk::new(16).unwrap(), &c),
            bwd(&Chunk::new(16).unwrap(), &c),
            op::forward_backward(&Chunk::new(16).unwrap(), &c.x, &c.opt, &c.d_o, Some(&c.dht))
                .unwrap(),
        ),
    ] {
        assert_eq!(bits(&b, &f), bits(&b2, &f2));
    }
}

/// The same bits on 1 and 3 rayon threads: naive, chunked and CP.
#[test]
fn bit_identical_for_any_thread_count() {
    let s = Spec {
        gate: GateKind::LowerBound { a_log: true },
        dt_bias: true,
        l2norm: true,
        ..Spec::new(Layout::varlen(&[33, 2, 40, 0, 17]), 8)
    };
    let c = case(&s);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let chunk = Chunk::new(16).unwrap();
            let plan = PlanSpec::Cuts(vec![10, 35, 60]);
            let (o, g, _) = cp::forward_backward(
                &chunk,
                &c.x,
                &c.opt,
                &c.d_o,
                Some(&c.dht),
                &plan,
                &CpOptions::default(),
            )
            .unwrap();
            [
                bits(&bwd(&Naive, &c), &fwd(&Naive, &c)),
                bits(&bwd(&chunk, &c), &fwd(&chunk, &c)),
                bits(&g, &o),
            ]
        })
    };
    assert_eq!(run(1), run(3));
}

/// `x`'s forward error must name `what`; the forward must not panic.
fn refused(x: &Gdn2Inputs<f64>, opt: &Gdn2Options, what: &str) -> Error {
    let e = op::forward(&Naive, x, opt).expect_err("must be refused");
    let same = x.validate(opt).expect_err("validate must refuse it too");
    assert_eq!(
        e.to_string(),
        same.to_string(),
        "`{what}`: validate vs forward"
    );
    assert!(
        e.to_string().contains(&format!("`{what}`")),
        "error for `{what}` does not name it: {e}"
    );
    e
}

#[test]
fn bad_inputs_are_refused_with_the_tensor_named() {
    let s = Spec {
        gate: GateKind::Softplus,
        dt_bias: true,
        ..Spec::new(Layout::varlen(&[3, 4]), 1)
    };
    let c = case(&s);
    let (g, opt) = (&c.x, &c.opt);
    let shape = |e: Error| assert!(matches!(e, Error::Shape { .. }), "{e}");
    let option = |e: Error| assert!(matches!(e, Error::Option { .. }), "{e}");
    let non_finite = |e: Error| assert!(matches!(e, Error::NonFinite { .. }), "{e}");
    let with = |f: &dyn Fn(&mut Gdn2Inputs<f64>)| {
        let mut x = g.clone();
        f(&mut x);
        x
    };
    // Shapes, tensor by tensor ([1, 7, 2, 4] q/k/g/b, [1, 7, 2, 3] v/w).
    shape(refused(
        &with(&|x| x.q = ArrayD::zeros(vec![1, 7, 2])),
        opt,
        "q",
    ));
    shape(refused(
        &with(&|x| x.q = ArrayD::zeros(vec![1, 7, 0, 4])),
        opt,
        "q",
    ));
    shape(refused(
        &with(&|x| x.k = ArrayD::zeros(vec![1, 7, 2, 5])),
        opt,
        "k",
    ));
    shape(refused(
        &with(&|x| x.g = ArrayD::zeros(vec![1, 7, 2])),
        opt,
        "g",
    ));
    shape(refused(
        &with(&|x| x.b = ArrayD::zeros(vec![1, 7, 2])),
        opt,
        "b",
    ));
    shape(refused(
        &with(&|x| x.v = ArrayD::zeros(vec![1, 7, 4, 3])),
        opt,
        "v",
    ));
    shape(refused(
        &with(&|x| x.v = ArrayD::zeros(vec![1, 7, 2, 0])),
        opt,
        "v",
    ));
    shape(refused(
        &with(&|x| x.w = ArrayD::zeros(vec![1, 7, 2, 4])),
        opt,
        "w",
    ));
    shape(refused(
        &with(&|x| x.a_log = Some(ArrayD::zeros(vec![3]))),
        opt,
        "A_log",
    ));
    shape(refused(
        &with(&|x| x.dt_bias = Some(ArrayD::zeros(vec![2]))),
        opt,
        "dt_bias",
    ));
    shape(refused(
        &with(&|x| x.initial_state = Some(ArrayD::zeros(vec![2, 2, 3, 4]))),
        opt,
        "initial_state",
    ));
    let vfirst = Gdn2Options {
        state_v_first: true,
        ..*opt
    };
    shape(refused(g, &vfirst, "initial_state"));
    assert!(matches!(
        refused(
            &with(&|x| x.cu_seqlens = Some(vec![0, 3, 8])),
            opt,
            "cu_seqlens"
        ),
        Error::CuSeqlens(_)
    ));
    // Values.
    non_finite(refused(&with(&|x| x.w[[0, 2, 1, 1]] = f64::NAN), opt, "w"));
    non_finite(refused(
        &with(&|x| x.b[[0, 6, 0, 3]] = f64::INFINITY),
        opt,
        "b",
    ));
    non_finite(refused(
        &with(&|x| x.a_log.as_mut().unwrap()[[1]] = f64::NAN),
        opt,
        "A_log",
    ));
    // Finite parameters whose decay −exp(A_log)·softplus(g + dt_bias) is not.
    non_finite(refused(
        &with(&|x| x.a_log.as_mut().unwrap()[[1]] = 800.0),
        opt,
        "g",
    ));
    // Options.
    let plain = Gdn2Options {
        use_gate_in_kernel: false,
        ..*opt
    };
    option(refused(g, &plain, "use_gate_in_kernel"));
    let no_gate = with(&|x| {
        x.a_log = None;
        x.dt_bias = None;
    });
    option(refused(
        &no_gate,
        &Gdn2Options {
            lower_bound: Some(-3.0),
            ..plain
        },
        "lower_bound",
    ));
    assert!(matches!(
        refused(&no_gate, opt, "A_log"),
        Error::Missing { .. }
    ));
    let safe = Gdn2Options {
        safe_gate: true,
        ..*opt
    };
    option(refused(g, &safe, "lower_bound"));
    option(refused(
        g,
        &Gdn2Options {
            lower_bound: Some(-6.0),
            ..safe
        },
        "lower_bound",
    ));
    option(refused(
        g,
        &Gdn2Options {
            lower_bound: Some(0.0),
            ..safe
        },
        "lower_bound",
    ));
    option(refused(
        g,
        &Gdn2Options {
            lower_bound: Some(f64::NAN),
            ..*opt
        },
        "lower_bound",
    ));
    option(refused(
        g,
        &Gdn2Options {
            scale: Some(f64::INFINITY),
            ..*opt
        },
        "scale",
    ));
    // What FLA accepts: safe_gate with lower_bound in [−5, 0), A_log optional
    // with lower_bound, a bounded gate outside [−5, 0) without safe_gate.
    op::forward(
        &Naive,
        g,
        &Gdn2Options {
            lower_bound: Some(-5.0),
            ..safe
        },
    )
    .expect("safe gate");
    op::forward(
        &Naive,
        &no_gate,
        &Gdn2Options {
            lower_bound: Some(-2.0),
            ..*opt
        },
    )
    .expect("no A_log");
    op::forward(
        &Naive,
        g,
        &Gdn2Options {
            lower_bound: Some(-7.0),
            ..*opt
        },
    )
    .expect("not safe");
    op::forward(
        &Naive,
        &no_gate,
        &Gdn2Options {
            safe_gate: true,
            ..plain
        },
    )
    .expect("safe_gate alone");
    // Upstream gradients.
    let back = |d_o: &ArrayD<f64>, dht: &ArrayD<f64>, what: &str| {
        let e = op::backward(&Naive, g, opt, d_o, Some(dht)).expect_err("must be refused");
        assert!(e.to_string().contains(&format!("`{what}`")), "{e}");
        e
    };
    shape(back(&ArrayD::zeros(vec![1, 7, 2, 4]), &c.dht, "do"));
    shape(back(&c.d_o, &ArrayD::zeros(vec![2, 2, 3, 4]), "dht"));
    let mut nan = c.d_o.clone();
    nan[[0, 3, 1, 2]] = f64::NAN;
    non_finite(back(&nan, &c.dht, "do"));
    let e = Chunk::new(48).expect_err("not a kernel chunk size");
    assert!(e.to_string().contains("`chunk_size`"), "{e}");
    // CP refuses a batch it cannot pack.
    let batch = case(&Spec::new(Layout::batch(2, 5), 2));
    let e = cp::forward(
        &Naive,
        &batch.x,
        &batch.opt,
        &PlanSpec::World(1),
        &CpOptions::default(),
    )
    .expect_err("B = 2");
    assert!(matches!(e, Error::Partition(_)), "{e}");
}

/// The names the operator declares, FLA's.
#[test]
fn declares_fla_names() {
    use deltaref::op::OpSpec;
    assert_eq!(Gdn2::NAME, "gdn2");
    assert_eq!(
        Gdn2::GRADS,
        ["dq", "dk", "dv", "dg", "db", "dw", "dA_log", "ddt_bias", "dh0"]
    );
    let s = Spec {
        gate: GateKind::Softplus,
        dt_bias: true,
        ..Spec::new(Layout::varlen(&[5, 2]), 6)
    };
    let c = case(&s);
    let (f, g) = (fwd(&Naive, &c), bwd(&Naive, &c));
    let names: Vec<&str> = op::named::<f64, Gdn2>(&f, Some(&g))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names,
        [
            "o",
            "final_state",
            "dq",
            "dk",
            "dv",
            "dg",
            "db",
            "dw",
            "dA_log",
            "ddt_bias",
            "dh0"
        ]
    );
}
