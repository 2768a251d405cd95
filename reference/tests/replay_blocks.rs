//! Where a block of replayed `[K, V]` states would not fit the cache, the
//! naive engines checkpoint more often (`sweep::state_block_len`). At
//! K = V = 256 their results must still be the chunked engines' (an
//! independent form) in f64.

mod common;

use common::assert_close;
use deltaref::dplr::{self, DplrGrads, DplrOptions, DplrOutputs};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaGrads, KdaOptions, KdaOutputs};
use deltaref::op;
use deltaref::sweep::{block_len, state_block_len};
use ndarray::ArrayD;

const L: usize = 400;
const D: usize = 256;

type Named = Vec<(&'static str, ArrayD<f64>)>;

/// The shape below takes the shortened blocks.
#[test]
fn the_shape_checkpoints_more_often_than_sqrt_l() {
    assert!(state_block_len(L, D * D * 8) < block_len(L));
}

fn assert_all_close(what: &str, naive: Named, chunk: Named) {
    for ((name, n), (_, c)) in naive.iter().zip(&chunk) {
        assert_close(&format!("{what} {name}"), n, c, 1e-10);
    }
}

fn kda_named((o, g): (KdaOutputs<f64>, KdaGrads<f64>)) -> Named {
    vec![
        ("o", o.o),
        ("ht", o.final_state.expect("ht")),
        ("dq", g.dq),
        ("dk", g.dk),
        ("dv", g.dv),
        ("dg", g.dg),
        ("dbeta", g.dbeta),
        ("dh0", g.dh0.expect("dh0")),
    ]
}

fn dplr_named((o, g): (DplrOutputs<f64>, DplrGrads<f64>)) -> Named {
    vec![
        ("o", o.o),
        ("ht", o.final_state.expect("ht")),
        ("dq", g.dq),
        ("dk", g.dk),
        ("dv", g.dv),
        ("da", g.da),
        ("db", g.db),
        ("dgk", g.dgk),
        ("dh0", g.dh0.expect("dh0")),
    ]
}

#[test]
fn kda_naive_matches_chunk_with_short_replay_blocks() {
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let g = inputs::kda(&KdaSpec {
        layout: Layout::batch(1, L),
        h: 1,
        hv: 1,
        k: D,
        v: D,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 3,
    });
    fn run<E: op::Engine<f64, Op = kda::Kda>>(
        e: &E,
        g: &inputs::Generated<kda::KdaInputs<f64>>,
        o: &KdaOptions,
    ) -> Named {
        kda_named(op::forward_backward(e, &g.inputs, o, &g.d_o, Some(&g.dht)).unwrap())
    }
    let chunk = kda::chunk::Chunk::new(64).unwrap();
    assert_all_close(
        "KDA",
        run(&kda::naive::Naive, &g, &opts),
        run(&chunk, &g, &opts),
    );
}

#[test]
fn dplr_naive_matches_chunk_with_short_replay_blocks() {
    let opts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let g = inputs::dplr(&DplrSpec {
        layout: Layout::batch(1, L),
        h: 1,
        k: D,
        v: D,
        initial_state: true,
        seed: 3,
    });
    fn run<E: op::Engine<f64, Op = dplr::Dplr>>(
        e: &E,
        g: &inputs::Generated<dplr::DplrInputs<f64>>,
        o: &DplrOptions,
    ) -> Named {
        dplr_named(op::forward_backward(e, &g.inputs, o, &g.d_o, Some(&g.dht)).unwrap())
    }
    let chunk = dplr::chunk::Chunk::new(64).unwrap();
    assert_all_close(
        "DPLR",
        run(&dplr::naive::Naive, &g, &opts),
        run(&chunk, &g, &opts),
    );
}
