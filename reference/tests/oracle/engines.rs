//! One test body per property, run on every registered (operator, engine)
//! pair through the operator contract ([`deltaref::op`]), in the style of
//! candle's `test_device!` / burn's `testgen_all!`: a new operator gets every
//! property by implementing [`Registered`] (a problem generator and its
//! tensors) and adding its engines to the `testgen!` list at the bottom.
//!
//! Properties: chunk = naive (≤ 1e-10 in f64), CP = non-CP (≤ 1e-10),
//! f32 close to f64, central finite differences of every gradient, and
//! results bit-identical for 1 and 3 rayon threads (plain and CP).

use deltaref::conv::{Activation, CausalConv1d, ConvOptions, Direct};
use deltaref::cp::{self, CpOptions, PlanSpec};
use deltaref::dplr::{self, Dplr, DplrOptions};
use deltaref::gates::Gate;
use deltaref::gdn::{Gdn, GdnOptions, OnKda};
use deltaref::inputs::{self, ConvSpec, DplrSpec, GdnSpec, KdaSpec, Layout, TokenShiftSpec};
use deltaref::kda::{self, Kda, KdaOptions};
use deltaref::op::{self, Engine, Operator};
use deltaref::rng::Stream;
use deltaref::tensor::cast;
use deltaref::token_shift::{Shift, TokenShift};
use ndarray::ArrayD;

/// Varlen with an empty and a one-token sequence, and sequences spanning
/// several chunks of 16.
const LENGTHS: [usize; 4] = [37, 0, 1, 26];
/// CP cut points inside sequences, on a sequence boundary, and one rank
/// holding a whole sequence.
const CUTS: [usize; 3] = [20, 38, 50];

/// One problem of an operator: inputs, options and upstream gradients.
struct Problem<O: Operator<f64>> {
    x: O::Inputs,
    opt: O::Options,
    d_o: ArrayD<f64>,
    dht: ArrayD<f64>,
}

/// What a test needs from an operator beyond the contract.
trait Registered: Operator<f64> + Operator<f32> {
    /// The reference engine (the naive recurrence).
    type Naive: Engine<f64, Op = Self> + Engine<f32, Op = Self> + Default;
    /// A small varlen problem over [`LENGTHS`] with every optional input.
    fn problem() -> Problem<Self>;
    /// The float input tensors, by FLA name.
    fn tensors_mut(
        x: &mut <Self as Operator<f64>>::Inputs,
    ) -> Vec<(&'static str, &mut ArrayD<f64>)>;
}

impl Registered for Kda {
    type Naive = kda::Naive;

    fn problem() -> Problem<Kda> {
        let opt = KdaOptions {
            output_final_state: true,
            use_qk_l2norm_in_kernel: true,
            gate: Gate::Kda,
            use_beta_sigmoid_in_kernel: true,
            ..Default::default()
        };
        let g = inputs::KdaSpec::generate(&KdaSpec {
            layout: Layout::varlen(&LENGTHS),
            h: 2,
            hv: 4,
            k: 8,
            v: 6,
            opts: opt,
            initial_state: true,
            scalar_gate: false,
            seed: 11,
        });
        Problem {
            x: g.inputs,
            opt,
            d_o: g.d_o,
            dht: g.dht,
        }
    }

    fn tensors_mut(x: &mut kda::KdaInputs<f64>) -> Vec<(&'static str, &mut ArrayD<f64>)> {
        let mut t = vec![
            ("q", &mut x.q),
            ("k", &mut x.k),
            ("v", &mut x.v),
            ("g", &mut x.g),
            ("beta", &mut x.beta),
        ];
        t.extend(x.a_log.as_mut().map(|a| ("A_log", a)));
        t.extend(x.dt_bias.as_mut().map(|a| ("dt_bias", a)));
        t.extend(x.initial_state.as_mut().map(|a| ("initial_state", a)));
        t
    }
}

impl Registered for Dplr {
    type Naive = dplr::Naive;

    fn problem() -> Problem<Dplr> {
        let g = inputs::DplrSpec::generate(&DplrSpec {
            layout: Layout::varlen(&LENGTHS),
            h: 3,
            k: 8,
            v: 6,
            initial_state: true,
            seed: 12,
        });
        Problem {
            x: g.inputs,
            opt: DplrOptions {
                output_final_state: true,
                ..Default::default()
            },
            d_o: g.d_o,
            dht: g.dht,
        }
    }

    fn tensors_mut(x: &mut dplr::DplrInputs<f64>) -> Vec<(&'static str, &mut ArrayD<f64>)> {
        let mut t = vec![
            ("q", &mut x.q),
            ("k", &mut x.k),
            ("v", &mut x.v),
            ("a", &mut x.a),
            ("b", &mut x.b),
            ("gk", &mut x.gk),
        ];
        t.extend(x.initial_state.as_mut().map(|a| ("initial_state", a)));
        t
    }
}

impl Registered for TokenShift {
    type Naive = Shift;

    fn problem() -> Problem<TokenShift> {
        let g = inputs::TokenShiftSpec::generate(&TokenShiftSpec {
            layout: Layout::varlen(&LENGTHS),
            d: 5,
            cache: true,
            seed: 13,
        });
        Problem {
            x: g.inputs,
            opt: (),
            d_o: g.d_o,
            dht: g.dht,
        }
    }

    fn tensors_mut(
        x: &mut deltaref::token_shift::TokenShiftInputs<f64>,
    ) -> Vec<(&'static str, &mut ArrayD<f64>)> {
        let mut t = vec![("x", &mut x.x)];
        t.extend(x.cache.as_mut().map(|a| ("cache", a)));
        t
    }
}

impl Registered for Gdn {
    type Naive = OnKda<kda::Naive>;

    fn problem() -> Problem<Gdn> {
        let opt = GdnOptions {
            output_final_state: true,
            use_qk_l2norm_in_kernel: true,
            use_gate_in_kernel: true,
            use_beta_sigmoid_in_kernel: true,
            state_v_first: true,
            ..Default::default()
        };
        let g = inputs::GdnSpec::generate(&GdnSpec {
            layout: Layout::varlen(&LENGTHS),
            h: 2,
            hv: 4,
            k: 8,
            v: 6,
            opts: opt,
            initial_state: true,
            seed: 14,
        });
        Problem {
            x: g.inputs,
            opt,
            d_o: g.d_o,
            dht: g.dht,
        }
    }

    fn tensors_mut(x: &mut deltaref::gdn::GdnInputs<f64>) -> Vec<(&'static str, &mut ArrayD<f64>)> {
        let mut t = vec![
            ("q", &mut x.q),
            ("k", &mut x.k),
            ("v", &mut x.v),
            ("g", &mut x.g),
            ("beta", &mut x.beta),
        ];
        t.extend(x.a_log.as_mut().map(|a| ("A_log", a)));
        t.extend(x.dt_bias.as_mut().map(|a| ("dt_bias", a)));
        t.extend(x.initial_state.as_mut().map(|a| ("initial_state", a)));
        t
    }
}

impl Registered for CausalConv1d {
    type Naive = Direct;

    fn problem() -> Problem<CausalConv1d> {
        let g = inputs::ConvSpec::generate(&ConvSpec {
            layout: Layout::varlen(&LENGTHS),
            d: 5,
            w: 4,
            bias: true,
            initial_state: true,
            seed: 15,
        });
        Problem {
            x: g.inputs,
            opt: ConvOptions {
                activation: Activation::Silu,
                output_final_state: true,
            },
            d_o: g.d_o,
            dht: g.dht,
        }
    }

    fn tensors_mut(
        x: &mut deltaref::conv::ConvInputs<f64>,
    ) -> Vec<(&'static str, &mut ArrayD<f64>)> {
        let mut t = vec![("x", &mut x.x), ("weight", &mut x.weight)];
        t.extend(x.bias.as_mut().map(|a| ("bias", a)));
        t.extend(x.initial_state.as_mut().map(|a| ("initial_state", a)));
        t
    }
}

/// Every output and gradient of `engine` in `T` (inputs narrowed from f64),
/// by name, widened to f64.
fn run<T: deltaref::Scalar, O: Registered + Operator<T>, E: Engine<T, Op = O>>(
    engine: &E,
    p: &Problem<O>,
    plan: Option<&PlanSpec>,
) -> Vec<(&'static str, ArrayD<f64>)> {
    let x = <O as Operator<T>>::narrow(&p.x);
    let opt = O::all_outputs(&p.opt);
    let (d_o, dht) = (cast::<f64, T>(&p.d_o), cast::<f64, T>(&p.dht));
    let (out, gr) = match plan {
        None => (
            op::forward(engine, &x, &opt).expect("valid"),
            op::backward(engine, &x, &opt, &d_o, Some(&dht)).expect("valid"),
        ),
        Some(plan) => {
            let cpo = CpOptions::default();
            (
                cp::forward(engine, &x, &opt, plan, &cpo).expect("valid").0,
                cp::backward(engine, &x, &opt, &d_o, Some(&dht), plan, &cpo)
                    .expect("valid")
                    .0,
            )
        }
    };
    op::named::<T, O>(&out, Some(&gr))
        .into_iter()
        .map(|(n, t)| (n, cast(t)))
        .collect()
}

/// `max |a − b| / max |b|` over every named tensor; panics naming the worst.
fn assert_close(what: &str, a: &[(&str, ArrayD<f64>)], b: &[(&str, ArrayD<f64>)], tol: f64) {
    let names =
        |m: &[(&str, ArrayD<f64>)]| m.iter().map(|(n, _)| n.to_string()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "{what}: tensor names");
    for ((name, x), (_, y)) in a.iter().zip(b) {
        assert_eq!(x.shape(), y.shape(), "{what}: {name} shape");
        let scale = y.iter().fold(0.0_f64, |m, v| m.max(v.abs())).max(1e-300);
        let err = x
            .iter()
            .zip(y.iter())
            .fold(0.0_f64, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            err / scale <= tol,
            "{what}: {name} relative error {:.3e} > {tol:.0e}",
            err / scale
        );
    }
}

fn bits(m: &[(&str, ArrayD<f64>)]) -> Vec<u64> {
    m.iter()
        .flat_map(|(_, t)| t.iter().map(|v| v.to_bits()))
        .collect()
}

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool")
        .install(f)
}

fn matches_naive<O: Registered, E: Engine<f64, Op = O>>(engine: &E) {
    let p = O::problem();
    let naive = run::<f64, O, _>(&O::Naive::default(), &p, None);
    assert_close(O::NAME, &run::<f64, O, _>(engine, &p, None), &naive, 1e-10);
}

fn cp_matches_non_cp<O: Registered, E: Engine<f64, Op = O>>(engine: &E) {
    let p = O::problem();
    let plain = run::<f64, O, _>(engine, &p, None);
    for plan in [PlanSpec::Cuts(CUTS.to_vec()), PlanSpec::World(4)] {
        let got = run::<f64, O, _>(engine, &p, Some(&plan));
        assert_close(&format!("{} CP {plan}", O::NAME), &got, &plain, 1e-10);
    }
}

fn f32_close_to_f64<O: Registered, E: Engine<f64, Op = O> + Engine<f32, Op = O>>(engine: &E) {
    let p = O::problem();
    let exact = run::<f64, O, _>(engine, &p, None);
    assert_close(O::NAME, &run::<f32, O, _>(engine, &p, None), &exact, 1e-4);
}

/// The loss the gradients are of: `Σ out₀·do + Σ out₁·dht`.
fn loss<O: Registered, E: Engine<f64, Op = O>>(
    engine: &E,
    p: &Problem<O>,
    x: &<O as Operator<f64>>::Inputs,
) -> f64 {
    let out = op::forward(engine, x, &O::all_outputs(&p.opt)).expect("valid");
    let named = op::named::<f64, O>(&out, None);
    let dot =
        |a: &ArrayD<f64>, b: &ArrayD<f64>| a.iter().zip(b.iter()).map(|(p, q)| p * q).sum::<f64>();
    dot(named[0].1, &p.d_o) + dot(named[1].1, &p.dht)
}

/// The gradient name of input `name` (FLA's: `d` + name; `dh0` for the initial state).
fn grad_name(name: &str) -> String {
    match name {
        "initial_state" => "dh0".into(),
        n => format!("d{n}"),
    }
}

/// Central differences along one random direction per input tensor against
/// the analytic directional derivative.
fn finite_differences<O: Registered, E: Engine<f64, Op = O>>(engine: &E) {
    let p = O::problem();
    let grads = run::<f64, O, _>(engine, &p, None);
    let mut x = p.x.clone();
    let names: Vec<&str> = O::tensors_mut(&mut x).into_iter().map(|(n, _)| n).collect();
    assert!(
        !names.is_empty(),
        "{}: no input tensors registered",
        O::NAME
    );
    let eps = 1e-6;
    for (i, name) in names.iter().enumerate() {
        let g = &grads
            .iter()
            .find(|(n, _)| *n == grad_name(name))
            .unwrap_or_else(|| panic!("{}: no gradient for {name}", O::NAME))
            .1;
        let dir = Stream::new(7 + i as u64, name).normals(g.len());
        let shifted = |sign: f64| {
            let mut x = p.x.clone();
            let mut ts = O::tensors_mut(&mut x);
            let t = &mut ts[i].1;
            t.iter_mut()
                .zip(&dir)
                .for_each(|(v, d)| *v += sign * eps * d);
            loss(engine, &p, &x)
        };
        let fd = (shifted(1.0) - shifted(-1.0)) / (2.0 * eps);
        let analytic: f64 = g.iter().zip(&dir).map(|(a, d)| a * d).sum();
        let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|a| a * a).sum::<f64>().sqrt();
        let scale = norm(&mut g.iter().copied()) * norm(&mut dir.iter().copied());
        assert!(
            (fd - analytic).abs() <= 1e-6 * scale.max(1e-12),
            "{}: {} finite difference {fd:.10e} vs analytic {analytic:.10e}",
            O::NAME,
            grad_name(name)
        );
    }
}

fn thread_count_invariant<O: Registered, E: Engine<f64, Op = O>>(engine: &E) {
    let p = O::problem();
    for plan in [None, Some(PlanSpec::Cuts(CUTS.to_vec()))] {
        let go = || bits(&run::<f64, O, _>(engine, &p, plan.as_ref()));
        assert_eq!(
            in_pool(1, go),
            in_pool(3, go),
            "{}: 1 vs 3 threads",
            O::NAME
        );
    }
}

/// `name: Op, engine;` → a module `name` with one test per property.
macro_rules! testgen {
    ($($name:ident: $op:ty, $engine:expr;)+) => {
        $(
            mod $name {
                use super::*;

                #[test]
                fn matches_naive() {
                    super::matches_naive::<$op, _>(&$engine);
                }

                #[test]
                fn cp_matches_non_cp() {
                    super::cp_matches_non_cp::<$op, _>(&$engine);
                }

                #[test]
                fn f32_close_to_f64() {
                    super::f32_close_to_f64::<$op, _>(&$engine);
                }

                #[test]
                fn finite_differences() {
                    super::finite_differences::<$op, _>(&$engine);
                }

                #[test]
                fn thread_count_invariant() {
                    super::thread_count_invariant::<$op, _>(&$engine);
                }
            }
        )+
    };
}

testgen! {
    kda_naive: Kda, kda::Naive;
    kda_chunk16: Kda, kda::Chunk::new(16).expect("valid");
    kda_chunk64: Kda, kda::Chunk::new(64).expect("valid");
    dplr_naive: Dplr, dplr::Naive;
    dplr_chunk16: Dplr, dplr::Chunk::new(16).expect("valid");
    token_shift: TokenShift, Shift;
    gdn_naive: Gdn, OnKda(kda::Naive);
    gdn_chunk16: Gdn, OnKda(kda::Chunk::new(16).expect("valid"));
    causal_conv1d: CausalConv1d, Direct;
}
