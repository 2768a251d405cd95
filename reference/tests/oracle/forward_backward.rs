//! One forward+backward run ([`op::forward_backward`], [`cp::forward_backward`])
//! gives the same bits as the separate forward and backward runs, for every
//! engine (the chunked ones keep their forward's intermediates instead of
//! recomputing them).

use deltaref::conv::{Activation, ConvOptions, Direct};
use deltaref::cp::PlanSpec;
use deltaref::cp::{self, CpOptions};
use deltaref::dplr::{self, DplrOptions};
use deltaref::gates::Gate;
use deltaref::gdn::{GdnOptions, OnKda};
use deltaref::inputs::{self, ConvSpec, DplrSpec, GdnSpec, KdaSpec, Layout, TokenShiftSpec};
use deltaref::kda::{self, KdaOptions};
use deltaref::op::{self, Engine, OpSpec, Operator};
use deltaref::precision::{Policy, Stage};
use deltaref::token_shift::Shift;
use deltaref::Dtype;
use ndarray::ArrayD;

/// Panics unless both lists hold the same tensors, bit for bit.
fn assert_same_bits(what: &str, a: &[(&str, &ArrayD<f64>)], b: &[(&str, &ArrayD<f64>)]) {
    assert_eq!(
        a.iter().map(|t| t.0).collect::<Vec<_>>(),
        b.iter().map(|t| t.0).collect::<Vec<_>>(),
        "{what}: tensor names"
    );
    for ((name, x), (_, y)) in a.iter().zip(b) {
        assert_eq!(x.shape(), y.shape(), "{what}: {name} shape");
        let differ = x
            .iter()
            .zip(y.iter())
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count();
        assert_eq!(differ, 0, "{what}: {name} differs in {differ} elements");
    }
}

/// `op::forward_backward` (each pair writing into the run's tensors)
/// against `op::forward` then `op::backward` (per-pair results assembled),
/// and the CP forms over three unequal ranks against `cp::forward` then
/// `cp::backward`.
fn check<E: Engine<f64>>(
    what: &str,
    engine: &E,
    x: &<E::Op as Operator<f64>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
    d_o: &ArrayD<f64>,
    dht: &ArrayD<f64>,
) {
    check_op(what, engine, x, opt, d_o, dht);
    let (plan, cpo) = (PlanSpec::Cuts(vec![70, 200]), CpOptions::default());
    let (out, _) = cp::forward(engine, x, opt, &plan, &cpo).expect("valid");
    let (gr, _) = cp::backward(engine, x, opt, d_o, Some(dht), &plan, &cpo).expect("valid");
    let (out1, gr1, _) =
        cp::forward_backward(engine, x, opt, d_o, Some(dht), &plan, &cpo).expect("valid");
    assert_same_bits(
        &format!("{what} under CP"),
        &op::named::<f64, E::Op>(&out, Some(&gr)),
        &op::named::<f64, E::Op>(&out1, Some(&gr1)),
    );
}

#[test]
fn kda_forward_backward_has_the_separate_runs_bits() {
    let opts = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::LowerBound { lower_bound: -5.0 },
        ..Default::default()
    };
    let g = inputs::KdaSpec::generate(&KdaSpec {
        layout: Layout::varlen(&[150, 106]),
        h: 2,
        hv: 2,
        k: 32,
        v: 16,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 5,
    });
    let (x, d_o, dht) = (&g.inputs, &g.d_o, &g.dht);
    check("kda naive", &kda::Naive, x, &opts, d_o, dht);
    for c in [16, 32, 64] {
        let chunk = kda::Chunk::new(c).expect("valid");
        check(&format!("kda chunk C={c}"), &chunk, x, &opts, d_o, dht);
        check_spans("kda", c, x, &opts, d_o, dht, |span, policy| {
            chunk.clone().with_policy(policy).with_span_len(span)
        });
    }
}

/// Pairs longer than a span run span by span in `op::forward_backward`
/// (the separate runs do not), ending in a short span: the same bits, also
/// with the stored states, state gradients and `v_new` rounded to bf16
/// (what a span's carries must not change either). `engine(span, policy)`
/// is the chunked engine of size `c` with both.
fn check_spans<E: Engine<f64>>(
    what: &str,
    c: usize,
    x: &<E::Op as Operator<f64>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
    d_o: &ArrayD<f64>,
    dht: &ArrayD<f64>,
    engine: impl Fn(usize, Policy) -> deltaref::Result<E>,
) {
    let bf16 = Policy::exact()
        .with(Stage::H, Dtype::Bf16)
        .with(Stage::Dh, Dtype::Bf16)
        .with(Stage::VNew, Dtype::Bf16);
    for (span, policy) in [(c, Policy::exact()), (c, bf16.clone()), (2 * c, bf16)] {
        let e = engine(span, policy).expect("valid");
        let what = format!("{what} chunk C={c}, spans of {span}");
        check_op(&what, &e, x, opt, d_o, dht);
    }
}

/// A span that is not a positive multiple of the chunk size is refused
/// by name, with the value.
fn assert_span_refused(span: deltaref::Result<impl std::fmt::Debug>, bad: usize) {
    let msg = span.expect_err("refused").to_string();
    assert!(
        msg.contains("span_len") && msg.contains(&bad.to_string()),
        "{msg}"
    );
}

#[test]
fn spans_are_positive_multiples_of_the_chunk_size() {
    let kda_chunk = kda::Chunk::new(32).expect("valid");
    let dplr_chunk = dplr::Chunk::new(32).expect("valid");
    for bad in [0, 48, 16] {
        assert_span_refused(kda_chunk.clone().with_span_len(bad), bad);
        assert_span_refused(dplr_chunk.clone().with_span_len(bad), bad);
    }
    assert!(kda_chunk.with_span_len(96).is_ok());
    assert!(dplr_chunk.with_span_len(96).is_ok());
}

#[test]
fn dplr_forward_backward_has_the_separate_runs_bits() {
    let opts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let g = inputs::DplrSpec::generate(&DplrSpec {
        layout: Layout::varlen(&[150, 106]),
        h: 2,
        k: 32,
        v: 16,
        initial_state: true,
        seed: 6,
    });
    let (x, d_o, dht) = (&g.inputs, &g.d_o, &g.dht);
    check("dplr naive", &dplr::Naive, x, &opts, d_o, dht);
    for c in [16, 32, 64] {
        let chunk = dplr::Chunk::new(c).expect("valid");
        check(&format!("dplr chunk C={c}"), &chunk, x, &opts, d_o, dht);
        check_spans("dplr", c, x, &opts, d_o, dht, |span, policy| {
            chunk.clone().with_policy(policy).with_span_len(span)
        });
    }
}

/// The `op` half of [`check`] (CP splits packed batches only).
fn check_op<E: Engine<f64>>(
    what: &str,
    engine: &E,
    x: &<E::Op as Operator<f64>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
    d_o: &ArrayD<f64>,
    dht: &ArrayD<f64>,
) {
    let out = op::forward(engine, x, opt).expect("valid");
    let gr = op::backward(engine, x, opt, d_o, Some(dht)).expect("valid");
    let (out1, gr1) = op::forward_backward(engine, x, opt, d_o, Some(dht)).expect("valid");
    assert_same_bits(
        what,
        &op::named::<f64, E::Op>(&out, Some(&gr)),
        &op::named::<f64, E::Op>(&out1, Some(&gr1)),
    );
}

/// Batch rows, odd K and V not a multiple of four (a row pair and a lone
/// row, chunk tails), and a packed batch with an empty sequence.
#[test]
fn naive_engines_write_every_layout_in_place() {
    for layout in [Layout::batch(2, 260), Layout::varlen(&[150, 0, 110])] {
        let opts = KdaOptions {
            output_final_state: true,
            ..Default::default()
        };
        let g = inputs::KdaSpec::generate(&KdaSpec {
            layout: layout.clone(),
            h: 3,
            hv: 3,
            k: 7,
            v: 9,
            opts,
            initial_state: true,
            scalar_gate: false,
            seed: 8,
        });
        check_op(
            "kda naive K=7 V=9",
            &kda::Naive,
            &g.inputs,
            &opts,
            &g.d_o,
            &g.dht,
        );
        let dopts = DplrOptions {
            output_final_state: true,
            ..Default::default()
        };
        let d = inputs::DplrSpec::generate(&DplrSpec {
            layout,
            h: 3,
            k: 7,
            v: 9,
            initial_state: true,
            seed: 9,
        });
        check_op(
            "dplr naive K=7 V=9",
            &dplr::Naive,
            &d.inputs,
            &dopts,
            &d.d_o,
            &d.dht,
        );
    }
}

/// The operators whose pairs' results are copied into the run's tensors
/// (GDN through KDA's engines, token-shift and causal conv1d).
#[test]
fn other_operators_forward_backward_has_the_separate_runs_bits() {
    let layout = Layout::varlen(&[150, 0, 106]);
    let opts = GdnOptions {
        output_final_state: true,
        use_gate_in_kernel: true,
        ..Default::default()
    };
    let g = inputs::GdnSpec::generate(&GdnSpec {
        layout: layout.clone(),
        h: 2,
        hv: 4,
        k: 8,
        v: 6,
        opts,
        initial_state: true,
        seed: 10,
    });
    let (x, d_o, dht) = (&g.inputs, &g.d_o, &g.dht);
    check("gdn naive", &OnKda(kda::Naive), x, &opts, d_o, dht);
    let chunk = OnKda(kda::Chunk::new(32).expect("valid"));
    check("gdn chunk", &chunk, x, &opts, d_o, dht);
    let t = inputs::TokenShiftSpec::generate(&TokenShiftSpec {
        layout: layout.clone(),
        d: 5,
        cache: true,
        seed: 11,
    });
    check("token shift", &Shift, &t.inputs, &(), &t.d_o, &t.dht);
    let c = inputs::ConvSpec::generate(&ConvSpec {
        layout,
        d: 6,
        w: 4,
        bias: true,
        initial_state: true,
        seed: 12,
    });
    let copts = ConvOptions {
        activation: Activation::Silu,
        output_final_state: true,
    };
    check("causal conv1d", &Direct, &c.inputs, &copts, &c.d_o, &c.dht);
}

/// The naive engines reuse per-thread working buffers without clearing
/// all of them (`scratch::overwritten`): a run after other runs on the same
/// threads has the bits of a run on fresh threads.
#[test]
fn reused_buffers_leave_no_trace() {
    let spec = |k, v, seed| KdaSpec {
        layout: Layout::varlen(&[70, 0, 45]),
        h: 2,
        hv: 2,
        k,
        v,
        opts: KdaOptions::default(),
        initial_state: true,
        scalar_gate: false,
        seed,
    };
    let run = |s: &KdaSpec| {
        let g = inputs::KdaSpec::generate(s);
        let (out, gr) = op::forward_backward(&kda::Naive, &g.inputs, &s.opts, &g.d_o, Some(&g.dht))
            .expect("valid");
        op::named::<f64, kda::Kda>(&out, Some(&gr))
            .into_iter()
            .map(|(n, t)| (n, t.clone()))
            .collect::<Vec<_>>()
    };
    let target = spec(12, 9, 31);
    let fresh = {
        let target = target.clone();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool");
        pool.install(|| run(&target))
    };
    for warm in [spec(16, 16, 1), spec(12, 9, 2), spec(7, 20, 3)] {
        run(&warm);
    }
    let warm = run(&target);
    let as_refs = |v: &Vec<(&'static str, ArrayD<f64>)>| {
        v.iter().map(|(n, t)| (*n, t.clone())).collect::<Vec<_>>()
    };
    let (a, b) = (as_refs(&fresh), as_refs(&warm));
    assert_same_bits(
        "after other runs",
        &a.iter().map(|(n, t)| (*n, t)).collect::<Vec<_>>(),
        &b.iter().map(|(n, t)| (*n, t)).collect::<Vec<_>>(),
    );
}
