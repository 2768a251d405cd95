//! Causal conv1d under simulated CP, FLA's `causal_conv1d_cp`
//! (`fla/modules/causal_conv1d/cp.py`): a rank whose first sequence continues
//! from earlier ranks starts that piece from the `W` tokens of `X` before its
//! first token, received from earlier ranks (FLA sends the previous rank's last
//! `W − 1` tokens and needs at least `W − 1` tokens per rank; here the window
//! is gathered from however many earlier ranks it spans, and reaches into the
//! sequence's initial state when the sequence started fewer than `W` tokens
//! before the cut, so any cut works). In backward, the gradient of that window
//! goes back to the tokens it came from (`dx` on earlier ranks) and to `dh0`.

use ndarray::{s, Array2, Array3, ArrayD, Ix3};

use super::{
    validate_upstream, ConvGrads, ConvInputs, ConvOptions, ConvOutputs, GradAccumulator, Prepared,
};
use crate::cp::plan::{Plan, PlanSpec};
use crate::error::Result;
use crate::scalar::Scalar;
use crate::varlen::Segment;

/// Where row `j` of a piece's window comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// Global token `t` of the packed row (sent by an earlier rank).
    Token(usize),
    /// Column `c` of the sequence's initial state.
    State(usize),
}

/// Sources of the `W` window rows before `seg`, a piece starting `p` tokens
/// into a sequence that begins at global token `seq_start`: row `j` is row
/// `p + j` of `X = [initial_state; x]`.
fn window_sources(seg: &Segment, seq_start: usize, w: usize) -> Vec<Source> {
    let p = seg.start - seq_start;
    (0..w)
        .map(|j| match p + j {
            m if m < w => Source::State(m),
            m => Source::Token(seq_start + m - w),
        })
        .collect()
}

/// The window `[W, D]` of piece `i` on rank `rm`.
fn window<T: Scalar>(p: &Prepared<T>, plan: &Plan, seg: &Segment) -> Array2<T> {
    let seq_start = plan.cu_seqlens[seg.seq] as usize;
    let h0 = p.initial_window(seg.seq);
    let mut win = Array2::zeros((p.dims.w, p.dims.d));
    for (j, src) in window_sources(seg, seq_start, p.dims.w)
        .into_iter()
        .enumerate()
    {
        match src {
            Source::State(c) => win.row_mut(j).assign(&h0.row(c)),
            Source::Token(t) => win.row_mut(j).assign(&p.x.slice(s![0, t, ..])),
        }
    }
    win
}

fn ends_sequence(plan: &Plan, seg: &Segment) -> bool {
    seg.end == plan.cu_seqlens[seg.seq + 1] as usize
}

/// CP forward: the same `y` and `final_state` as [`super::forward`].
pub fn forward<T: Scalar>(
    x: &ConvInputs<T>,
    opt: &ConvOptions,
    plan: &PlanSpec,
) -> Result<ConvOutputs<T>> {
    let p = Prepared::new(x, opt)?;
    let d = p.dims;
    let plan = plan.build(d.b, d.t, x.cu_seqlens.as_deref())?;
    let mut y = Array3::zeros((d.b, d.t, d.d));
    // Sequences without tokens keep their initial state.
    let mut ht =
        p.h0.map(|h| h.to_owned())
            .unwrap_or_else(|| Array3::zeros((d.n, d.d, d.w)));
    for rm in &plan.ranks {
        for seg in &rm.pieces {
            let (ys, last) = p.piece_forward(seg, window(&p, &plan, seg).view());
            y.slice_mut(s![0, seg.start..seg.end, ..]).assign(&ys);
            if ends_sequence(&plan, seg) {
                ht.slice_mut(s![seg.seq, .., ..]).assign(&last.t());
            }
        }
    }
    Ok(ConvOutputs {
        y: y.into_dyn(),
        final_state: opt.output_final_state.then(|| ht.into_dyn()),
    })
}

/// CP backward: the same gradients as [`super::backward`]; window gradients
/// of continuing pieces are sent back and added after every rank's local pass.
pub fn backward<T: Scalar>(
    x: &ConvInputs<T>,
    opt: &ConvOptions,
    dy: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
    plan: &PlanSpec,
) -> Result<ConvGrads<T>> {
    let p = Prepared::new(x, opt)?;
    let d = p.dims;
    validate_upstream(&d, dy, dht)?;
    let plan = plan.build(d.b, d.t, x.cu_seqlens.as_deref())?;
    let dy = dy.view().into_dimensionality::<Ix3>().expect("validated");
    let dht = dht.map(|a| a.view().into_dimensionality::<Ix3>().expect("validated"));
    let mut acc = GradAccumulator::new(&d);
    // A sequence without tokens passes its final-state gradient to h0.
    if let Some(dht) = &dht {
        for seq in 0..d.n {
            if plan.cu_seqlens[seq] == plan.cu_seqlens[seq + 1] {
                acc.dh0
                    .slice_mut(s![seq, .., ..])
                    .assign(&dht.slice(s![seq, .., ..]));
            }
        }
    }
    let mut sent_back = vec![];
    for rm in &plan.ranks {
        for seg in &rm.pieces {
            let dlast = match (&dht, ends_sequence(&plan, seg)) {
                (Some(a), true) => a.slice(s![seg.seq, .., ..]).t().to_owned(),
                _ => Array2::zeros((d.w, d.d)),
            };
            let g = p.piece_backward(
                seg,
                window(&p, &plan, seg).view(),
                dy.slice(s![0, seg.start..seg.end, ..]),
                dlast.view(),
            );
            acc.add_piece(seg, &g);
            let seq_start = plan.cu_seqlens[seg.seq] as usize;
            sent_back.push((*seg, seq_start, g.dwindow));
        }
    }
    for (seg, seq_start, dwin) in sent_back {
        for (j, src) in window_sources(&seg, seq_start, d.w).into_iter().enumerate() {
            match src {
                Source::State(c) => {
                    let mut col = acc.dh0.slice_mut(s![seg.seq, .., c]);
                    col += &dwin.row(j);
                }
                Source::Token(t) => {
                    let mut row = acc.dx.slice_mut(s![0, t, ..]);
                    row += &dwin.row(j);
                }
            }
        }
    }
    Ok(acc.finish(x))
}
