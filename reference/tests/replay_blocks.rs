//! Where a block of replayed `[K, V]` states would not fit the cache, the
//! naive engines checkpoint more often (`sweep::state_block_len`). At
//! K = V = 256 their results must still be the chunked engines' (an
//! independent form) in f64.

mod common;

use common::assert_close;
use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};
use deltaref::op;
use deltaref::sweep::{block_len, state_block_len};

const L: usize = 400;
const D: usize = 256;

/// The shape below takes the shortened blocks.
#[test]
fn the_shape_checkpoints_more_often_than_sqrt_l() {
    assert!(state_block_len(L, D * D * 8) < block_len(L));
}

/// The naive and chunked engines' outputs and gradients on `g` within
/// 1e-10 of each other, every one present in both.
fn naive_matches_chunk<O, N, C>(
    naive: &N,
    chunk: &C,
    g: &inputs::Generated<O::Inputs>,
    opts: &O::Options,
) where
    O: op::Operator<f64>,
    N: op::Engine<f64, Op = O>,
    C: op::Engine<f64, Op = O>,
{
    let (no, ng) = op::forward_backward(naive, &g.inputs, opts, &g.d_o, Some(&g.dht)).unwrap();
    let (co, cg) = op::forward_backward(chunk, &g.inputs, opts, &g.d_o, Some(&g.dht)).unwrap();
    let (n, c) = (
        op::named::<f64, O>(&no, Some(&ng)),
        op::named::<f64, O>(&co, Some(&cg)),
    );
    let names = |v: &[(&'static str, _)]| v.iter().map(|(s, _)| *s).collect::<Vec<_>>();
    assert_eq!(names(&n), names(&c), "{}: tensors", O::NAME);
    assert!(
        n.len() >= 8,
        "{}: outputs, final state and gradients",
        O::NAME
    );
    for ((name, n), (_, c)) in n.iter().zip(&c) {
        assert_close(&format!("{} {name}", O::NAME), n, c, 1e-10);
    }
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
    let chunk = kda::chunk::Chunk::new(64).unwrap();
    naive_matches_chunk(&kda::naive::Naive, &chunk, &g, &opts);
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
    let chunk = dplr::chunk::Chunk::new(64).unwrap();
    naive_matches_chunk(&dplr::naive::Naive, &chunk, &g, &opts);
}
