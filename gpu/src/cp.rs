//! Simulated context parallel on one GPU (SPEC §6), for any engine: every
//! rank's pre-process runs in one launch over the ranks' pieces, the
//! all-gathered `(S_ext, M)` are merged by the `cp_merge` kernel, and every
//! rank recomputes its pieces from the merged state. Rank metadata comes from
//! the oracle's [`Plan`] (FLA's `FLACPContext` rules).

use cudarc::driver::{CudaSlice, PushKernelArg};
use deltaref::cp::{Plan, PlanSpec, RankMeta};
use deltaref::varlen::{self, Segment};

use crate::device::{arg_opt, grid, Gpu};
use crate::error::Result;
use crate::kernels::{Defines, CP};

/// One engine's view of a prepared problem: runs pieces of sequences.
/// Buffers of states are `[pieces, heads, K, V]` (f32, row-major).
pub(crate) trait Recurrence {
    /// Per-token gradient buffers the backward writes into.
    type Grads;

    fn gpu(&self) -> &Gpu;

    /// `(heads, K, V)`.
    fn shape(&self) -> (usize, usize, usize);

    /// Runs `pieces` from `h0` (zeros when `None`), writing `o` for their
    /// tokens when given; returns the final states.
    fn forward(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        o: Option<&mut CudaSlice<f32>>,
    ) -> Result<CudaSlice<f32>>;

    /// Gradients of `Σ o·do + Σ S_L·dht` for the pieces' tokens into `grads`;
    /// returns `dh0`.
    fn backward(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        dht: Option<&CudaSlice<f32>>,
        grads: &mut Self::Grads,
    ) -> Result<CudaSlice<f32>>;

    /// The transitions `M [pieces, heads, K, K]`.
    fn transition(&self, pieces: &[Segment]) -> Result<CudaSlice<f32>>;

    /// Throw-away gradient buffers (for the backward pre-process).
    fn scratch_grads(&self) -> Result<Self::Grads>;
}

/// A run's two phases on the device: the final states, the gradients and
/// `dh0`, with each phase's seconds.
pub(crate) struct Phases<G> {
    pub ht: CudaSlice<f32>,
    pub grads: G,
    pub dh0: CudaSlice<f32>,
    pub forward_s: f64,
    pub backward_s: f64,
}

/// The forward of `rec` (writing `o`) and then its backward, over the
/// sequences of a `[B, T]` batch (or of `cu_seqlens`), split over ranks by
/// `cp` when given; each phase timed with the stream drained (`op` names
/// them in errors).
pub(crate) fn forward_backward<R: Recurrence>(
    rec: &R,
    op: &str,
    (b, t, cu_seqlens): (usize, usize, Option<&[i64]>),
    cp: Option<&PlanSpec>,
    (h0, dht): (Option<&CudaSlice<f32>>, Option<&CudaSlice<f32>>),
    o: &mut CudaSlice<f32>,
) -> Result<Phases<R::Grads>> {
    let segs = &varlen::sequences(b, t, cu_seqlens)?;
    let plan = cp.map(|spec| spec.build(b, t, cu_seqlens)).transpose()?;
    let plan = plan.as_ref();
    let gpu = rec.gpu();
    let (ht, forward_s) = gpu.timed(&format!("{op} forward"), || match plan {
        None => rec.forward(segs, h0, Some(o)),
        Some(plan) => forward(rec, plan, h0, o),
    })?;
    let ((grads, dh0), backward_s) = gpu.timed(&format!("{op} backward"), || {
        let mut g = rec.scratch_grads()?;
        let dh0 = match plan {
            None => rec.backward(segs, h0, dht, &mut g)?,
            Some(plan) => backward(rec, plan, h0, dht, &mut g)?,
        };
        Ok((g, dh0))
    })?;
    Ok(Phases {
        ht,
        grads,
        dh0,
        forward_s,
        backward_s,
    })
}

/// Elements of one `[heads, K, V]` state.
fn state_len<R: Recurrence>(r: &R) -> usize {
    let (h, k, v) = r.shape();
    h * k * v
}

fn seq_start(plan: &Plan, seq: usize) -> usize {
    plan.cu_seqlens[seq] as usize
}

fn seq_end(plan: &Plan, seq: usize) -> usize {
    plan.cu_seqlens[seq + 1] as usize
}

/// The pieces of every rank in plan order, with `(rank, first, last)`.
fn all_pieces(plan: &Plan) -> Vec<(Segment, &RankMeta, bool, bool)> {
    plan.ranks
        .iter()
        .flat_map(|r| {
            let n = r.pieces.len();
            r.pieces
                .iter()
                .enumerate()
                .map(move |(i, &s)| (s, r, i == 0, i + 1 == n))
        })
        .collect()
}

/// `cp_merge` over every rank: row `r` of the result is the chain of
/// `plan_rows[r] = (seq or −1, first, count)` over `m`/`e`.
#[allow(clippy::too_many_arguments)]
fn merge<R: Recurrence>(
    rec: &R,
    m: &CudaSlice<f32>,
    e: &CudaSlice<f32>,
    init: Option<&CudaSlice<f32>>,
    rows: &[[i32; 3]],
    backward: bool,
) -> Result<CudaSlice<f32>> {
    let gpu = rec.gpu();
    let (heads, kd, vd) = rec.shape();
    let mut out = gpu.zeros::<f32>("merged CP states", rows.len() * heads * kd * vd)?;
    let flat: Vec<i32> = rows.iter().flatten().copied().collect();
    let plan_rows = gpu.upload("CP merge plan", &flat)?;
    let f = gpu.function(
        &CP,
        Defines {
            in_bf16: false,
            kd,
            chunk: 0,
        },
        "cp_merge",
    )?;
    let (step, transpose, hv, ncol) = (
        if backward { -1i32 } else { 1 },
        i32::from(backward),
        heads as i32,
        vd as i32,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(m).arg(e);
    arg_opt(&mut b, init);
    b.arg(&mut out)
        .arg(&plan_rows)
        .arg(&step)
        .arg(&transpose)
        .arg(&hv)
        .arg(&ncol);
    gpu.launch(b, "cp_merge", grid(rows.len(), heads, vd, 0))?;
    Ok(out)
}

/// Forward pre-process and merge: the merged initial state of every rank
/// (`[R, heads, K, V]`, meaningful for ranks that continue a sequence).
fn merged_h0<R: Recurrence>(
    rec: &R,
    plan: &Plan,
    h0: Option<&CudaSlice<f32>>,
) -> Result<CudaSlice<f32>> {
    let lasts: Vec<Segment> = plan
        .ranks
        .iter()
        .map(|r| *r.pieces.last().expect("a rank holds at least one token"))
        .collect();
    let s_ext = rec.forward(&lasts, None, None)?;
    let m = rec.transition(&lasts)?;
    let rows: Vec<[i32; 3]> = plan
        .ranks
        .iter()
        .map(|r| {
            if !r.continues() {
                return [-1, 0, 0];
            }
            let seq = if h0.is_some() {
                r.pieces[0].seq as i32
            } else {
                -1
            };
            [
                seq,
                (r.rank - r.pre_num_ranks) as i32,
                r.pre_num_ranks as i32,
            ]
        })
        .collect();
    merge(rec, &m, &s_ext, h0, &rows, false)
}

/// The initial state of every piece: merged (a continuing rank's first
/// piece), the sequence's own (its first piece), else zeros.
fn piece_h0<R: Recurrence>(
    rec: &R,
    plan: &Plan,
    merged: &CudaSlice<f32>,
    h0: Option<&CudaSlice<f32>>,
) -> Result<CudaSlice<f32>> {
    let n = state_len(rec);
    let pieces = all_pieces(plan);
    let gpu = rec.gpu();
    let mut out = gpu.zeros::<f32>("per-piece initial states", pieces.len() * n)?;
    for (i, (seg, rank, first, _)) in pieces.iter().enumerate() {
        if *first && rank.continues() {
            gpu.copy(merged, rank.rank * n, &mut out, i * n, n)?;
        } else if let (Some(h0), true) = (h0, seg.start == seq_start(plan, seg.seq)) {
            gpu.copy(h0, seg.seq * n, &mut out, i * n, n)?;
        }
    }
    Ok(out)
}

/// CP forward: writes `o` for every token; returns the final state of every
/// sequence `[N, heads, K, V]` (zero-length sequences keep their initial state).
pub(crate) fn forward<R: Recurrence>(
    rec: &R,
    plan: &Plan,
    h0: Option<&CudaSlice<f32>>,
    o: &mut CudaSlice<f32>,
) -> Result<CudaSlice<f32>> {
    let merged = merged_h0(rec, plan, h0)?;
    let starts = piece_h0(rec, plan, &merged, h0)?;
    let pieces = all_pieces(plan);
    let segs: Vec<Segment> = pieces.iter().map(|p| p.0).collect();
    let finals = rec.forward(&segs, Some(&starts), Some(o))?;
    let n = state_len(rec);
    let seqs = plan.cu_seqlens.len() - 1;
    let gpu = rec.gpu();
    let mut ht = gpu.zeros::<f32>("final states", seqs * n)?;
    if let Some(h0) = h0 {
        gpu.copy(h0, 0, &mut ht, 0, seqs * n)?;
    }
    for (i, (seg, ..)) in pieces.iter().enumerate() {
        if seg.end == seq_end(plan, seg.seq) {
            gpu.copy(&finals, i * n, &mut ht, seg.seq * n, n)?;
        }
    }
    Ok(ht)
}

/// CP backward: every token's gradients into `grads`; returns `dh0
/// [N, heads, K, V]` (a zero-length sequence passes its `dht` through).
pub(crate) fn backward<R: Recurrence>(
    rec: &R,
    plan: &Plan,
    h0: Option<&CudaSlice<f32>>,
    dht: Option<&CudaSlice<f32>>,
    grads: &mut R::Grads,
) -> Result<CudaSlice<f32>> {
    let gpu = rec.gpu();
    let (heads, kd, _) = rec.shape();
    let n = state_len(rec);
    let world = plan.ranks.len();
    let merged = merged_h0(rec, plan, h0)?;
    // Backward pre-process on each continuing rank's first piece: dS_ext with
    // zero incoming dht, and that piece's transition (dM = Mᵀ).
    let firsts: Vec<&RankMeta> = plan.ranks.iter().filter(|r| r.continues()).collect();
    let mut ds_ext = gpu.zeros::<f32>("dS_ext", world * n)?;
    let mut m_first = gpu.zeros::<f32>("first-piece transitions", world * heads * kd * kd)?;
    if !firsts.is_empty() {
        let segs: Vec<Segment> = firsts.iter().map(|r| r.pieces[0]).collect();
        let mut scratch = rec.scratch_grads()?;
        let d = rec.backward(&segs, None, None, &mut scratch)?;
        let m = rec.transition(&segs)?;
        for (i, r) in firsts.iter().enumerate() {
            gpu.copy(&d, i * n, &mut ds_ext, r.rank * n, n)?;
            gpu.copy(
                &m,
                i * heads * kd * kd,
                &mut m_first,
                r.rank * heads * kd * kd,
                heads * kd * kd,
            )?;
        }
    }
    let rows: Vec<[i32; 3]> = plan
        .ranks
        .iter()
        .map(|r| {
            if !r.continued() {
                return [-1, 0, 0];
            }
            let last = r.pieces.last().expect("non-empty rank");
            let seq = if dht.is_some() { last.seq as i32 } else { -1 };
            [
                seq,
                (r.rank + r.post_num_ranks) as i32,
                r.post_num_ranks as i32,
            ]
        })
        .collect();
    let merged_dht = merge(rec, &m_first, &ds_ext, dht, &rows, true)?;
    let starts = piece_h0(rec, plan, &merged, h0)?;
    let pieces = all_pieces(plan);
    let mut ends = gpu.zeros::<f32>("per-piece final-state gradients", pieces.len() * n)?;
    for (i, (seg, rank, _, last)) in pieces.iter().enumerate() {
        if *last && rank.continued() {
            gpu.copy(&merged_dht, rank.rank * n, &mut ends, i * n, n)?;
        } else if let (Some(dht), true) = (dht, seg.end == seq_end(plan, seg.seq)) {
            gpu.copy(dht, seg.seq * n, &mut ends, i * n, n)?;
        }
    }
    let segs: Vec<Segment> = pieces.iter().map(|p| p.0).collect();
    let d_starts = rec.backward(&segs, Some(&starts), Some(&ends), grads)?;
    let seqs = plan.cu_seqlens.len() - 1;
    let mut dh0 = gpu.zeros::<f32>("dh0", seqs * n)?;
    if let Some(dht) = dht {
        gpu.copy(dht, 0, &mut dh0, 0, seqs * n)?;
    }
    for (i, (seg, ..)) in pieces.iter().enumerate() {
        if seg.start == seq_start(plan, seg.seq) {
            gpu.copy(&d_starts, i * n, &mut dh0, seg.seq * n, n)?;
        }
    }
    Ok(dh0)
}
