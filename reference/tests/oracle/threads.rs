//! Results are bit-identical whatever the rayon thread count.

use deltaref::dplr::{self, DplrOptions};
use deltaref::gates::Gate;
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};
use deltaref::op;
use ndarray::ArrayD;

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool")
        .install(f)
}

fn bits(xs: &[&ArrayD<f64>]) -> Vec<u64> {
    xs.iter()
        .flat_map(|a| a.iter().map(|v| v.to_bits()))
        .collect()
}

#[test]
fn kda_and_dplr_are_bit_identical_for_1_and_4_threads() {
    let opts = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::Kda,
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: Layout::varlen(&[40, 0, 1, 70, 33]),
        h: 2,
        hv: 4,
        k: 8,
        v: 8,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 3,
    };
    let g = inputs::KdaSpec::generate(&spec);
    let run_kda = || {
        let o = op::forward(&kda::Naive, &g.inputs, &opts).expect("valid");
        let gr = op::backward(&kda::Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
        let fs = o.final_state.expect("asked");
        bits(&[
            &o.o,
            &fs,
            &gr.dq,
            &gr.dk,
            &gr.dv,
            &gr.dg,
            &gr.dbeta,
            gr.da_log.as_ref().unwrap(),
            gr.ddt_bias.as_ref().unwrap(),
            gr.dh0.as_ref().unwrap(),
        ])
    };
    assert_eq!(in_pool(1, run_kda), in_pool(4, run_kda));

    let d = inputs::DplrSpec::generate(&DplrSpec {
        layout: Layout::varlen(&[50, 3, 77]),
        h: 3,
        k: 8,
        v: 8,
        initial_state: true,
        seed: 4,
    });
    let dopts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let run_dplr = || {
        let o = op::forward(&dplr::Naive, &d.inputs, &dopts).expect("valid");
        let gr =
            op::backward(&dplr::Naive, &d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
        bits(&[
            &o.o,
            o.final_state.as_ref().unwrap(),
            &gr.dq,
            &gr.dk,
            &gr.dv,
            &gr.da,
            &gr.db,
            &gr.dgk,
        ])
    };
    assert_eq!(in_pool(1, run_dplr), in_pool(4, run_dplr));
}

/// The chunked engines run their intra stages and per-chunk backward in
/// parallel over the chunks of one head, and their state passes over blocks
/// of value columns: one sequence and one head of many (partly short)
/// chunks, so the chunks and columns, not the heads, are what is split
/// (V = 20: blocks of 8, 8 and 4 columns on 3 or 4 threads). On one thread
/// the two pairs fill the threads and each runs chunk by chunk, each intra
/// stage before its state step and each chunk's backward after its state
/// step. The one-run forward+backward gives the separate runs' bits.
#[test]
fn chunk_engines_are_bit_identical_for_1_3_and_4_threads() {
    let opts = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::LowerBound { lower_bound: -5.0 },
        ..Default::default()
    };
    let g = inputs::KdaSpec::generate(&KdaSpec {
        layout: Layout::varlen(&[150, 7]),
        h: 1,
        hv: 1,
        k: 8,
        v: 20,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 5,
    });
    let run_kda = || {
        let engine = kda::Chunk::new(16).expect("a chunk size");
        let o = op::forward(&engine, &g.inputs, &opts).expect("valid");
        let gr = op::backward(&engine, &g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
        let (o1, gr1) =
            op::forward_backward(&engine, &g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
        assert_eq!(o1.o, o.o);
        assert_eq!(o1.final_state, o.final_state);
        assert_eq!(
            [&gr1.dq, &gr1.dk, &gr1.dv, &gr1.dg],
            [&gr.dq, &gr.dk, &gr.dv, &gr.dg]
        );
        assert_eq!((&gr1.dbeta, &gr1.dh0), (&gr.dbeta, &gr.dh0));
        bits(&[
            &o.o,
            o.final_state.as_ref().unwrap(),
            &gr.dq,
            &gr.dk,
            &gr.dv,
            &gr.dg,
            &gr.dbeta,
            gr.dh0.as_ref().unwrap(),
        ])
    };
    let one = in_pool(1, run_kda);
    assert_eq!(one, in_pool(3, run_kda));
    assert_eq!(one, in_pool(4, run_kda));

    let d = inputs::DplrSpec::generate(&DplrSpec {
        layout: Layout::varlen(&[130, 5]),
        h: 1,
        k: 8,
        v: 20,
        initial_state: true,
        seed: 6,
    });
    let dopts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let run_dplr = || {
        let engine = dplr::Chunk::new(16).expect("a chunk size");
        let o = op::forward(&engine, &d.inputs, &dopts).expect("valid");
        let gr = op::backward(&engine, &d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
        let (o1, gr1) =
            op::forward_backward(&engine, &d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
        assert_eq!(o1.o, o.o);
        assert_eq!(o1.final_state, o.final_state);
        assert_eq!(
            [&gr1.dq, &gr1.dk, &gr1.dv, &gr1.da, &gr1.db, &gr1.dgk],
            [&gr.dq, &gr.dk, &gr.dv, &gr.da, &gr.db, &gr.dgk]
        );
        assert_eq!(gr1.dh0, gr.dh0);
        bits(&[
            &o.o,
            o.final_state.as_ref().unwrap(),
            &gr.dq,
            &gr.dk,
            &gr.dv,
            &gr.da,
            &gr.db,
            &gr.dgk,
            gr.dh0.as_ref().unwrap(),
        ])
    };
    let one = in_pool(1, run_dplr);
    assert_eq!(one, in_pool(3, run_dplr));
    assert_eq!(one, in_pool(4, run_dplr));
}
