//! Where a block of replayed `[K, V]` states would not fit the cache, the
//! naive engines checkpoint more often (and hold more states than at the
//! `√L` spacing: `deltaref::registry::MemoryModel::held_states`). At
//! K = V = 256 their results must still be the chunked engines' (an
//! independent form) in f64. In f32 KDA's replay takes two chunks of
//! columns an iteration, and its leftovers, where f64 takes one.

use crate::common;

use common::assert_close;
use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, Kda, KdaOptions};
use deltaref::op;
use deltaref::registry::MemoryModel;
use deltaref::tensor::cast;

const L: usize = 400;
const D: usize = 256;

/// The shape below takes the shortened blocks: its backward holds more
/// states than the `√L` spacing's checkpoints and block.
#[test]
fn the_shape_checkpoints_more_often_than_sqrt_l() {
    let sqrt = MemoryModel::block_len(L);
    assert!(MemoryModel::held_states(L, D * D * 8) > L.div_ceil(sqrt) + sqrt);
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
    let g = inputs::KdaSpec::generate(&KdaSpec {
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
    let chunk = kda::Chunk::new(64).unwrap();
    naive_matches_chunk(&kda::Naive, &chunk, &g, &opts);
}

#[test]
fn dplr_naive_matches_chunk_with_short_replay_blocks() {
    let opts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let g = inputs::DplrSpec::generate(&DplrSpec {
        layout: Layout::batch(1, L),
        h: 1,
        k: D,
        v: D,
        initial_state: true,
        seed: 3,
    });
    let chunk = dplr::Chunk::new(64).unwrap();
    naive_matches_chunk(&dplr::Naive, &chunk, &g, &opts);
}

/// In f32 the KDA backward replays two chunks of four columns an iteration
/// (`kda::naive::replay_group`), then a leftover chunk and the leftover
/// columns. At V = 13 (eight, four, one) and 16 (eight, eight), K = 5 (a
/// lone last row) and 8, its outputs and gradients must stay within f32's
/// error of the f64 run: a state replayed from the wrong columns is off by
/// O(1).
#[test]
fn kda_naive_f32_replays_wide_chunks_and_their_leftovers() {
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    for (k, v) in [(5, 13), (8, 16), (8, 13)] {
        let g = inputs::KdaSpec::generate(&KdaSpec {
            layout: Layout::varlen(&[23, 40]),
            h: 2,
            hv: 2,
            k,
            v,
            opts,
            initial_state: true,
            scalar_gate: false,
            seed: 5,
        });
        let naive = &kda::Naive;
        let (o, gr) = op::forward_backward(naive, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap();
        let x = <Kda as op::Operator<f32>>::narrow(&g.inputs);
        let (d_o, dht) = (cast::<f64, f32>(&g.d_o), cast::<f64, f32>(&g.dht));
        let (o32, gr32) = op::forward_backward(naive, &x, &opts, &d_o, Some(&dht)).unwrap();
        let exact = op::named::<f64, Kda>(&o, Some(&gr));
        let narrow = op::named::<f32, Kda>(&o32, Some(&gr32));
        assert_eq!(exact.len(), narrow.len());
        assert!(exact.len() >= 8, "outputs, final state and gradients");
        for ((name, e), (_, n)) in exact.iter().zip(&narrow) {
            assert_close(&format!("K={k} V={v} f32 {name}"), e, &cast(*n), 1e-4);
        }
    }
}
