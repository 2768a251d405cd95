//! Simulated context parallel (KCP, SPEC §6), rank by rank, in exact
//! arithmetic. One packed batch is cut into rank slices ([`Plan`]); each rank
//! pre-processes its last local sequence into `(S_ext, M)`, the ranks
//! all-gather, each merges the chain of its first sequence's earlier ranks,
//! and recomputes. Backward mirrors it with `(dS_ext, Mᵀ)`.
//!
//! The driver is generic over the operator contract ([`crate::op`]), one
//! (piece, head) at a time, so the same code runs every operator with any
//! engine (naive, chunked). Beyond FLA,
//! `initial_state` and `final_state` are allowed: the first rank of a
//! sequence starts from its initial state.

// Intra-card CP's cut rule and the rank slices, re-exported below.
pub(crate) mod intra;
pub(crate) mod plan;

use ndarray::{s, Array2, Array4, ArrayD, ArrayView2, ArrayView4};

use crate::error::Result;
use crate::fast::gemm;
use crate::fast::par::par_pairs;
use crate::op::{Engine, OpSpec, Operator, Prepared as _};
use crate::precision::{Feature, Policy, Stage};
use crate::scalar::Scalar;
use crate::tensor;
use crate::varlen::Segment;
pub use intra::{compute_subseq_len, plan_spec, split_points, IntraParams};
pub use plan::{Layout, Plan, PlanSpec, RankMeta};

/// What an operator hands from rank to rank under context parallel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carry {
    /// A delta-rule state `[K, V]` per head: pre-process `(S_ext, M)`, merge.
    State,
    /// The last tokens of the previous rank (token-shift, convolution).
    Tokens,
}

/// What a precision policy may ask of CP (over any engine) on top of the
/// engine's own stages: the `M` chain (each product of transitions, in the
/// merge and inside a chunked engine's transition), `S_ext` and the merged
/// state.
pub const FEATURES: &[Feature] = &[
    Feature::Round(Stage::MChain),
    Feature::Round(Stage::SExt),
    Feature::Round(Stage::Merged),
];

/// One problem seen piece by piece: the pre-processed inputs, the engine
/// and, for backward, the upstream gradients.
struct Local<'p, 'a, T: Scalar + 'a, E: Engine<T>> {
    p: &'p <E::Op as Operator<T>>::Prepared<'a>,
    engine: &'p E,
    /// `[B, T, heads, V]`
    d_o: Option<ArrayView4<'p, T>>,
    /// `[N, heads, K, V]`
    dht: Option<ArrayView4<'p, T>>,
}

impl<T: Scalar, E: Engine<T>> Local<'_, '_, T, E> {
    fn heads(&self) -> usize {
        self.p.shape().heads
    }

    /// `(K, V)` of the state.
    fn state_dims(&self) -> (usize, usize) {
        let sh = self.p.shape();
        (sh.k, sh.v)
    }

    /// The global initial state of sequence `seq`, if one was given.
    fn initial_state(&self, seq: usize, h: usize) -> Option<Array2<T>> {
        self.p.h0().map(|a| a.slice(s![seq, h, .., ..]).to_owned())
    }

    /// The global final-state gradient of sequence `seq`, if one was given.
    fn dht(&self, seq: usize, h: usize) -> Option<Array2<T>> {
        self.dht
            .as_ref()
            .map(|a| a.slice(s![seq, h, .., ..]).to_owned())
    }

    /// `(o [L, V], S_L [K, V])`.
    fn forward(&self, seg: &Segment, h: usize, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        self.engine.forward(&E::Op::head(self.p, seg, h), h0)
    }

    /// `(token gradients, dh0)` given the state gradient `dht` at the piece's end.
    fn backward(
        &self,
        seg: &Segment,
        h: usize,
        h0: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> (HeadGrads<T, E>, Array2<T>) {
        let d_o = self.d_o.as_ref().expect("backward needs do");
        let g = self.engine.backward(
            &E::Op::head(self.p, seg, h),
            h0,
            tensor::head_view(d_o.view(), seg, h),
            dht,
        );
        let dh0 = E::Op::head_dh0(&g).clone();
        (g, dh0)
    }

    /// [`Local::forward`] and [`Local::backward`] in one engine call.
    #[allow(clippy::type_complexity)]
    fn forward_backward(
        &self,
        seg: &Segment,
        h: usize,
        h0: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ((Array2<T>, Array2<T>), HeadGrads<T, E>, Array2<T>) {
        let d_o = self.d_o.as_ref().expect("backward needs do");
        let (fwd, g) = self.engine.forward_backward(
            &E::Op::head(self.p, seg, h),
            h0,
            tensor::head_view(d_o.view(), seg, h),
            dht,
        );
        let dh0 = E::Op::head_dh0(&g).clone();
        (fwd, g, dh0)
    }

    /// `M [K, K]` of the piece.
    fn transition(&self, seg: &Segment, h: usize) -> Array2<T> {
        self.engine.transition(&E::Op::head(self.p, seg, h))
    }
}

/// The per-piece gradients of engine `E`.
type HeadGrads<T, E> = <<E as Engine<T>>::Op as Operator<T>>::HeadGrads;

/// CP forward: the same outputs as [`crate::op::forward`], computed rank by
/// rank over `plan`, with the per-rank diagnostics.
#[allow(clippy::type_complexity)]
pub fn forward<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: &<E::Op as Operator<T>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
    plan: &PlanSpec,
    cp: &CpOptions,
) -> Result<(<E::Op as Operator<T>>::Outputs, Vec<RankDiag<T>>)> {
    let p = engine.stored(E::Op::prepare(x, opt)?);
    let d = p.shape();
    let plan = plan.build(d.b, d.t, E::Op::cu_seqlens(x))?;
    check_faults::<T, E>(&p, &cp.faults)?;
    let local = Local::<T, E> {
        p: &p,
        engine,
        d_o: None,
        dht: None,
    };
    let f = run_forward(&local, &plan, cp);
    Ok((outputs::<T, E>(&p, opt, f.o, &f.final_states), f.diags))
}

/// The public outputs from per-(piece, head) outputs and the final states.
fn outputs<T: Scalar, E: Engine<T>>(
    p: &<E::Op as Operator<T>>::Prepared<'_>,
    opt: &<E::Op as OpSpec>::Options,
    pieces: Vec<(Segment, usize, Array2<T>)>,
    final_states: &[(usize, usize, Array2<T>)],
) -> <E::Op as Operator<T>>::Outputs {
    let d = p.shape();
    let o = tensor::assemble((d.b, d.t, d.heads, d.v), pieces);
    // Sequences without tokens keep their initial state.
    let mut ht = p
        .h0()
        .map(|h0| h0.to_owned())
        .unwrap_or_else(|| Array4::zeros((d.n, d.heads, d.k, d.v)));
    for (seq, h, st) in final_states {
        ht.slice_mut(s![*seq, *h, .., ..]).assign(st);
    }
    E::Op::outputs(opt, o, ht)
}

/// CP backward: the same gradients as [`crate::op::backward`], computed rank
/// by rank over `plan`, with the per-rank diagnostics (forward's included).
#[allow(clippy::type_complexity)]
pub fn backward<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: &<E::Op as Operator<T>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
    plan: &PlanSpec,
    cp: &CpOptions,
) -> Result<(<E::Op as Operator<T>>::Grads, Vec<RankDiag<T>>)> {
    let (_, grads, diags) = backward_run(engine, x, opt, d_o, dht, plan, cp, false)?;
    Ok((grads, diags))
}

/// [`forward`] and [`backward`] in one run, the same bits: each piece's
/// forward and backward are one [`Engine::forward_backward`] call, so the CP
/// forward is not run twice. Returns `(outputs, gradients, diagnostics)`.
#[allow(clippy::type_complexity)]
pub fn forward_backward<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: &<E::Op as Operator<T>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
    plan: &PlanSpec,
    cp: &CpOptions,
) -> Result<(
    <E::Op as Operator<T>>::Outputs,
    <E::Op as Operator<T>>::Grads,
    Vec<RankDiag<T>>,
)> {
    let (out, grads, diags) = backward_run(engine, x, opt, d_o, dht, plan, cp, true)?;
    Ok((out.expect("asked for the outputs"), grads, diags))
}

/// The CP backward, with the outputs too when `with_outputs`.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn backward_run<T: Scalar, E: Engine<T>>(
    engine: &E,
    x: &<E::Op as Operator<T>>::Inputs,
    opt: &<E::Op as OpSpec>::Options,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
    plan: &PlanSpec,
    cp: &CpOptions,
    with_outputs: bool,
) -> Result<(
    Option<<E::Op as Operator<T>>::Outputs>,
    <E::Op as Operator<T>>::Grads,
    Vec<RankDiag<T>>,
)> {
    let p = engine.stored(E::Op::prepare(x, opt)?);
    let d = p.shape();
    E::Op::validate_upstream(&p, d_o, dht)?;
    let plan = plan.build(d.b, d.t, E::Op::cu_seqlens(x))?;
    check_faults::<T, E>(&p, &cp.faults)?;
    let local = Local::<T, E> {
        p: &p,
        engine,
        d_o: Some(E::Op::upstream_view(d_o)),
        dht: dht.map(|a| E::Op::dht_view(opt, a)),
    };
    let b = run_backward(&local, &plan, cp, with_outputs);
    let out = b
        .outputs
        .map(|(o, final_states)| outputs::<T, E>(&p, opt, o, &final_states));
    // A sequence without tokens passes its final-state gradient straight to h0.
    let mut dh0 = local
        .dht
        .map(|a| a.to_owned())
        .unwrap_or_else(|| Array4::zeros((d.n, d.heads, d.k, d.v)));
    for (seq, h, g) in &b.dh0 {
        dh0.slice_mut(s![*seq, *h, .., ..]).assign(g);
    }
    Ok((out, E::Op::grads(x, opt, &p, b.grads, dh0), b.diags))
}

/// Deliberate faults from FLA's history (SPEC §9, 4–6), to see what they do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// 4: every continuing rank recomputes its backward with a zero initial
    /// state instead of the merged one.
    pub drop_merged_state_in_backward: bool,
    /// 5: the merge covers only the first `n` columns of V (a stale block size).
    pub merge_v_limit: Option<usize>,
    /// 6: the pre-process runs on the rank's first local sequence instead of its last.
    pub preprocess_first_piece: bool,
    /// The state a rank hands on is not carried across the cut (token-shift's
    /// cache, conv1d's window: FLA's `pre_num_conv_tokens` left at 0): each
    /// continuing rank's first piece runs from zeros, forward and backward,
    /// and, the carried value being a constant, no gradient goes back to the
    /// previous rank (its last piece's `dht` is zero).
    pub carry_dropped: bool,
    /// The forward carries the state, but the gradient of a continuing
    /// rank's initial state is not added back into the previous rank
    /// (token-shift's `dx[-1] += recv_grad` left out): each continued rank's
    /// last piece gets `dht = 0`.
    pub carry_grad_dropped: bool,
    /// FLA #781, with its chunk size: the backward pre-process (`dS_ext` of
    /// each continuing rank's first piece, `pre_process_bwd_kernel_*`) decays
    /// the carried `dh` at every chunk boundary by head 0's `exp(gk_last)`
    /// instead of its own head's (the `gk` load missed the `i_h·K` offset);
    /// the chunk's own reads of the state use the right gates. Operators
    /// without a per-channel gate are refused.
    pub bwd_preprocess_head0_decay: Option<usize>,
    /// A stale `cu_seqlens_cpu`, with the chunk size: each rank's chunk
    /// indices come from the global `cu_seqlens` instead of its local one,
    /// so local sequence `i` is covered only for as many chunks as global
    /// sequence `i` has (none past the global count). The chunks the indices
    /// miss are never computed: their tokens get zero outputs and gradients
    /// and add nothing to the state. The pre-process and merge (which loop
    /// over the local `cu_seqlens`) are unaffected.
    pub stale_chunk_indices: Option<usize>,
    /// DPLR's pre-process with the sign of its low-rank term flipped, with
    /// the chunk size: each chunk's transition `Diag(γ) + bgᵀw` taken as
    /// `Diag(γ) − bgᵀw` (the KDA/GDN rule `Diag − kᵀw` applied to `bg`), in
    /// the `M` of the merge and of the backward's `Mᵀ` chain.
    pub transition_low_rank_negated: Option<usize>,
    /// FLA #822 pitfall 2, `expand_h0` run after the backward's forward
    /// recompute: the merged initial state is still the `[1, H, K, V]`
    /// buffer of the rank's first local sequence, so the recompute of every
    /// later local sequence of a continuing rank indexes past it and starts
    /// from stale memory instead of zeros. Modelled as the stale rows being
    /// the first sequence's merged state (the allocator's leftovers are
    /// undefined; zeros would hide the bug). The forward is untouched.
    pub h0_expanded_late: bool,
}

impl Faults {
    /// Whether a fault needs the operator's per-channel decay
    /// ([`Operator::decay_log_sum`]).
    fn needs_decay(&self) -> bool {
        self.bwd_preprocess_head0_decay.is_some() || self.transition_low_rank_negated.is_some()
    }
}

/// How the simulation stores the cross-rank quantities, and which faults to inject.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CpOptions {
    /// Rounds `S_ext`, the merged state and the merge's `M·S` products (`M` chain).
    pub policy: Policy,
    pub faults: Faults,
    /// Leave out the per-rank table's non-CP references (`reference_h0`,
    /// `reference_dht`): one more forward and backward over each sequence
    /// that a rank cuts, which the outputs never need.
    pub skip_reference_runs: bool,
}

/// Per-rank diagnostics, per head where a state is involved.
#[derive(Clone, Debug)]
pub struct RankDiag<T> {
    pub meta: RankMeta,
    /// `S_ext` of the piece the pre-process ran on (last local sequence), per
    /// head. Computed on every rank for the table; FLA leaves it zero on an
    /// `is_last_rank` rank, whose value no merge reads.
    pub s_ext: Vec<Array2<T>>,
    /// `M` of that piece, per head.
    pub m: Vec<Array2<T>>,
    /// Merged initial state of the first local sequence (when it continues), per head.
    pub merged_h0: Option<Vec<Array2<T>>>,
    /// The non-CP state at the rank's first token: the sequence run forward
    /// with the same engine, in pieces between the ranks' cuts with the state
    /// handed on whole, no CP merge (so the difference is the CP path's
    /// alone, not the engine's).
    pub reference_h0: Option<Vec<Array2<T>>>,
    /// `dS_ext` handed to the previous rank (backward, when it continues), per head.
    pub ds_ext: Option<Vec<Array2<T>>>,
    /// `M` of the first local sequence, whose transpose carries `dS` back (`dM`).
    pub m_first: Option<Vec<Array2<T>>>,
    /// Merged `dht` of the last local sequence (backward, when it is continued).
    pub merged_dht: Option<Vec<Array2<T>>>,
    /// The non-CP state gradient at the end of the rank's slice: the rest of
    /// the sequence run backward from its global `dht`, same engine, in
    /// pieces between the ranks' cuts.
    pub reference_dht: Option<Vec<Array2<T>>>,
}

fn max_abs_diff<T: Scalar>(a: &[Array2<T>], b: &[Array2<T>]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            x.iter()
                .zip(y.iter())
                .map(|(p, q)| (p.f64() - q.f64()).abs())
        })
        .fold(0.0, f64::max)
}

impl<T: Scalar> RankDiag<T> {
    /// The same diagnostics in f64 (exact widening).
    pub fn widen(self) -> RankDiag<f64> {
        let w = |v: Vec<Array2<T>>| v.iter().map(|a| a.mapv(|x| x.f64())).collect::<Vec<_>>();
        RankDiag {
            meta: self.meta,
            s_ext: w(self.s_ext),
            m: w(self.m),
            merged_h0: self.merged_h0.map(w),
            reference_h0: self.reference_h0.map(w),
            ds_ext: self.ds_ext.map(w),
            m_first: self.m_first.map(w),
            merged_dht: self.merged_dht.map(w),
            reference_dht: self.reference_dht.map(w),
        }
    }

    /// `max |merged − non-CP|` of the initial state, when the rank continues.
    pub fn h0_error(&self) -> Option<f64> {
        Some(max_abs_diff(
            self.merged_h0.as_ref()?,
            self.reference_h0.as_ref()?,
        ))
    }

    /// `max |merged − non-CP|` of the final-state gradient, when continued.
    pub fn dht_error(&self) -> Option<f64> {
        Some(max_abs_diff(
            self.merged_dht.as_ref()?,
            self.reference_dht.as_ref()?,
        ))
    }
}

/// The layout the diagnostics come from (zigzag plans have back parts).
pub fn layout_of<T>(diags: &[RankDiag<T>]) -> Layout {
    if diags.iter().any(|d| d.meta.back) {
        Layout::Zigzag
    } else {
        Layout::Contiguous
    }
}

/// The per-rank table: one row per rank, its local `cu_seqlens`, how many
/// ranks it merges from and hands on to, and the norms of what crosses the
/// cut. `carry` picks the columns: a delta-rule state (`S_ext`, the
/// transition `M`, the merged initial state and `dht`) or the token cache
/// of token-shift and conv1d (the cache a rank hands on, the merged cache it
/// starts from and their gradients; no `M`: a cache is replaced, not
/// transformed). `vs nonCP` is `max |merged − non-CP|`.
pub fn table<T: Scalar>(diags: &[RankDiag<T>], carry: Carry) -> String {
    let norm = |v: &Option<Vec<Array2<T>>>| {
        v.as_ref().map_or("-".to_string(), |v| {
            let s: f64 = v
                .iter()
                .flat_map(|a| a.iter().map(|x| x.f64() * x.f64()))
                .sum();
            format!("{:.4e}", s.sqrt())
        })
    };
    let err = |e: Option<f64>| e.map_or("-".to_string(), |e| format!("{e:.2e}"));
    let layout = layout_of(diags);
    let heads: [&str; 7] = match carry {
        Carry::State => [
            "|S_ext|",
            "|M|",
            "|merged h0|",
            "vs nonCP",
            "|dS_ext|",
            "|merged dht|",
            "vs nonCP",
        ],
        Carry::Tokens => [
            "|cache out|",
            "",
            "|cache in|",
            "vs nonCP",
            "|dcache out|",
            "|dcache in|",
            "vs nonCP",
        ],
    };
    let row = |c: [String; 12]| -> String {
        let line = match carry {
            Carry::State => format!(
                "{:<8} {:<13} {:<22} {:>4} {:>5}  {:>11} {:>11} {:>11} {:>9}  {:>11} {:>11} {:>9}",
                c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11]
            ),
            Carry::Tokens => format!(
                "{:<8} {:<13} {:<22} {:>4} {:>5}  {:>11} {:>11} {:>9}  {:>12} {:>12} {:>9}",
                c[0], c[1], c[2], c[3], c[4], c[5], c[7], c[8], c[9], c[10], c[11]
            ),
        };
        line + "\n"
    };
    let mut out = row([
        "rank",
        "tokens",
        "local cu_seqlens",
        "pre",
        "post",
        heads[0],
        heads[1],
        heads[2],
        heads[3],
        heads[4],
        heads[5],
        heads[6],
    ]
    .map(String::from));
    for d in diags {
        let m = &d.meta;
        let cu = format!("{:?}", m.cu_seqlens);
        out += &row([
            m.label(layout),
            format!("{}..{}", m.start, m.end),
            if cu.len() > 22 {
                format!("{}…", &cu[..21])
            } else {
                cu
            },
            m.pre_num_ranks.to_string(),
            m.post_num_ranks.to_string(),
            norm(&Some(d.s_ext.clone())),
            norm(&Some(d.m.clone())),
            norm(&d.merged_h0),
            err(d.h0_error()),
            norm(&d.ds_ext),
            norm(&d.merged_dht),
            err(d.dht_error()),
        ]);
    }
    out
}

/// One piece's place in the plan.
#[derive(Clone, Copy, Debug)]
struct PieceRef {
    rank: usize,
    /// Its index among the rank's local sequences.
    local: usize,
    seg: Segment,
    /// First / last piece of its rank.
    first: bool,
    last: bool,
}

fn pieces(plan: &Plan) -> Vec<PieceRef> {
    plan.ranks
        .iter()
        .flat_map(|r| {
            let n = r.pieces.len();
            r.pieces.iter().enumerate().map(move |(i, &seg)| PieceRef {
                rank: r.rank,
                local: i,
                seg,
                first: i == 0,
                last: i + 1 == n,
            })
        })
        .collect()
}

/// The global start and end of sequence `seq`.
fn seq_bounds(plan: &Plan, seq: usize) -> (usize, usize) {
    (
        plan.cu_seqlens[seq] as usize,
        plan.cu_seqlens[seq + 1] as usize,
    )
}

/// One rank's pre-process result, per head.
struct PreProcess<T> {
    s_ext: Vec<Array2<T>>,
    m: Vec<Array2<T>>,
}

/// Per-rank pre-process `(S_ext, M)` per head, on the last (or, under fault
/// 6, the first) local piece with a zero initial state.
fn preprocess<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    plan: &Plan,
    opt: &CpOptions,
) -> Vec<PreProcess<T>> {
    let (kd, vd) = local.state_dims();
    let heads = local.heads();
    let per = par_pairs(plan.world(), heads, |r, h| {
        let rm = &plan.ranks[r];
        let seg = if opt.faults.preprocess_first_piece {
            rm.pieces[0]
        } else {
            *rm.pieces.last().expect("non-empty rank")
        };
        let mut s_ext = local.forward(&seg, h, Array2::zeros((kd, vd)).view()).1;
        opt.policy.round(Stage::SExt, &mut s_ext);
        (s_ext, transition(local, &seg, h, &opt.faults))
    });
    let mut out: Vec<PreProcess<T>> = (0..plan.world())
        .map(|_| PreProcess {
            s_ext: vec![],
            m: vec![],
        })
        .collect();
    for (i, (s, m)) in per.into_iter().enumerate() {
        out[i / heads].s_ext.push(s);
        out[i / heads].m.push(m);
    }
    out
}

/// The merged initial state of each continuing rank's first piece, per head.
fn merge_forward<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    plan: &Plan,
    pre: &[PreProcess<T>],
    opt: &CpOptions,
) -> Vec<Option<Vec<Array2<T>>>> {
    let (kd, vd) = local.state_dims();
    plan.ranks
        .iter()
        .map(|rm| {
            if !rm.continues() {
                return None;
            }
            if opt.faults.carry_dropped {
                return Some(vec![Array2::zeros((kd, vd)); local.heads()]);
            }
            let seq = rm.pieces[0].seq;
            Some(
                (0..local.heads())
                    .map(|h| {
                        let mut s = local
                            .initial_state(seq, h)
                            .unwrap_or_else(|| Array2::zeros((kd, vd)));
                        for PreProcess { s_ext, m } in &pre[rm.rank - rm.pre_num_ranks..rm.rank] {
                            let mut ms = gemm::dot(m[h].view(), s.view());
                            opt.policy.round(Stage::MChain, &mut ms);
                            s = ms + &s_ext[h];
                        }
                        opt.policy.round(Stage::Merged, &mut s);
                        if let Some(n) = opt.faults.merge_v_limit {
                            s.slice_mut(s![.., n.min(vd)..]).fill(T::zero());
                        }
                        s
                    })
                    .collect(),
            )
        })
        .collect()
}

/// The initial state a piece runs from: merged (continuing first piece),
/// the sequence's own initial state (its first piece), else zeros.
fn piece_h0<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    plan: &Plan,
    p: &PieceRef,
    h: usize,
    merged: &[Option<Vec<Array2<T>>>],
) -> Array2<T> {
    let (kd, vd) = local.state_dims();
    if p.first && plan.ranks[p.rank].continues() {
        return merged[p.rank]
            .as_ref()
            .expect("merged for continuing ranks")[h]
            .clone();
    }
    if p.seg.start == seq_bounds(plan, p.seg.seq).0 {
        if let Some(h0) = local.initial_state(p.seg.seq, h) {
            return h0;
        }
    }
    Array2::zeros((kd, vd))
}

/// The stale initial state the backward recompute of piece `p` (head `h`)
/// reads under [`Faults::h0_expanded_late`]: a later local sequence of a
/// continuing rank gets the rank's merged state; `None` otherwise.
fn stale_h0<T: Scalar>(
    opt: &CpOptions,
    p: &PieceRef,
    h: usize,
    merged: &[Option<Vec<Array2<T>>>],
) -> Option<Array2<T>> {
    (opt.faults.h0_expanded_late && !p.first)
        .then(|| merged[p.rank].as_ref().map(|m| m[h].clone()))
        .flatten()
}

/// Result of a CP forward: per (piece, head) outputs in plan order, and the
/// final state of every sequence that has tokens.
struct CpForward<T> {
    /// `(piece, head, o [L, V])`.
    pub o: Vec<(Segment, usize, Array2<T>)>,
    /// `(seq, head, final state)` from the piece ending each sequence.
    pub final_states: Vec<(usize, usize, Array2<T>)>,
    pub diags: Vec<RankDiag<T>>,
}

/// The non-CP states entering token `at` of sequence `seq`, one
/// `[heads]` list per request `(seq, at)` (`at` inside the sequence): per
/// sequence and head one forward from its initial state over the tokens up
/// to the last request, run piece by piece between the requested tokens, the
/// state handed on whole as within one run. Each request costs its own
/// piece, not a prefix: the per-rank table of a long sequence over `R`
/// ranks runs one forward, not `R / 2`.
fn reference_states<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    plan: &Plan,
    requests: &[(usize, usize)],
) -> Vec<Vec<Array2<T>>> {
    let (kd, vd) = local.state_dims();
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| requests[i]);
    chained(
        requests,
        &order,
        local.heads(),
        |seq, h| {
            let h0 = local.initial_state(seq, h);
            (
                seq_bounds(plan, seq).0,
                h0.unwrap_or_else(|| Array2::zeros((kd, vd))),
            )
        },
        |_, h, piece, s0| local.forward(piece, h, s0.view()).1,
    )
}

/// `[request][head]` values at the requested tokens `(seq, at)`. Per head,
/// the requests in `order` (a permutation of them, each sequence's together
/// and in the order of its pass) are reached one after the other:
/// `run(i, h, piece, value)` carries the value over the tokens between the
/// previous request's token (or, for a sequence's first request, the token
/// of its `origin(seq, h) = (token, value)`) and `at` of request `i`,
/// whichever way the pass goes; an empty piece hands the value on as it is.
fn chained<T: Clone>(
    requests: &[(usize, usize)],
    order: &[usize],
    heads: usize,
    origin: impl Fn(usize, usize) -> (usize, Array2<T>),
    run: impl Fn(usize, usize, &Segment, &Array2<T>) -> Array2<T>,
) -> Vec<Vec<Array2<T>>> {
    let mut out: Vec<Vec<Array2<T>>> = vec![Vec::with_capacity(heads); requests.len()];
    for h in 0..heads {
        let mut prev: Option<(usize, usize, Array2<T>)> = None;
        for &i in order {
            let (seq, at) = requests[i];
            let (from, value) = match prev.take() {
                Some((s, p, value)) if s == seq => (p, value),
                _ => origin(seq, h),
            };
            let piece = Segment {
                seq,
                batch: 0,
                start: from.min(at),
                end: from.max(at),
            };
            let value = if piece.is_empty() {
                value
            } else {
                run(i, h, &piece, &value)
            };
            out[i].push(value.clone());
            prev = Some((seq, at, value));
        }
    }
    out
}

/// CP forward over `plan`.
fn run_forward<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    plan: &Plan,
    opt: &CpOptions,
) -> CpForward<T> {
    let diags = merged_states(local, plan, opt);
    let merged: Vec<_> = diags.iter().map(|d| d.merged_h0.clone()).collect();
    let ps = pieces(plan);
    let segs = computed_segments(plan, &ps, &opt.faults);
    let runs = par_pairs(ps.len(), local.heads(), |i, h| {
        let p = &ps[i];
        local.forward(&segs[i], h, piece_h0(local, plan, p, h, &merged).view())
    });
    let (o, final_states) = piece_outputs(plan, &ps, &segs, local.heads(), runs);
    CpForward {
        o,
        final_states,
        diags,
    }
}

/// Per-(piece, head) outputs `(piece, head, o)` in plan order and the final
/// state of every sequence ending in a piece, from the pieces' forward
/// results `(o, S_L)` in pair order over the tokens `segs` each piece computed.
#[allow(clippy::type_complexity)]
fn piece_outputs<T: Scalar>(
    plan: &Plan,
    ps: &[PieceRef],
    segs: &[Segment],
    heads: usize,
    runs: Vec<(Array2<T>, Array2<T>)>,
) -> (
    Vec<(Segment, usize, Array2<T>)>,
    Vec<(usize, usize, Array2<T>)>,
) {
    let mut o = Vec::with_capacity(runs.len());
    let mut final_states = vec![];
    for (i, (oh, sh)) in runs.into_iter().enumerate() {
        let (p, h) = (&ps[i / heads], i % heads);
        if p.seg.end == seq_bounds(plan, p.seg.seq).1 {
            final_states.push((p.seg.seq, h, sh));
        }
        o.push((segs[i / heads], h, oh));
    }
    (o, final_states)
}

/// The forward's pre-process and merge: the per-rank diagnostics, with the
/// merged initial state of each continuing rank's first piece.
fn merged_states<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    plan: &Plan,
    opt: &CpOptions,
) -> Vec<RankDiag<T>> {
    let pre = preprocess(local, plan, opt);
    let merged = merge_forward(local, plan, &pre, opt);
    let wanted = |rm: &RankMeta| rm.continues() && !opt.skip_reference_runs;
    let requests: Vec<(usize, usize)> = plan
        .ranks
        .iter()
        .filter(|rm| wanted(rm))
        .map(|rm| (rm.pieces[0].seq, rm.start))
        .collect();
    let mut references = reference_states(local, plan, &requests).into_iter();
    plan.ranks
        .iter()
        .zip(pre)
        .zip(&merged)
        .map(|((rm, PreProcess { s_ext, m }), mh)| RankDiag {
            meta: rm.clone(),
            s_ext,
            m,
            merged_h0: mh.clone(),
            reference_h0: wanted(rm).then(|| references.next().expect("one per request")),
            ds_ext: None,
            m_first: None,
            merged_dht: None,
            reference_dht: None,
        })
        .collect()
}

/// Result of a CP backward: per (piece, head) token gradients, `dh0` of every
/// sequence's first piece, and the diagnostics (forward and backward).
struct CpBackward<T, G> {
    /// The forward's per-piece outputs and final states, when asked for.
    #[allow(clippy::type_complexity)]
    pub outputs: Option<(
        Vec<(Segment, usize, Array2<T>)>,
        Vec<(usize, usize, Array2<T>)>,
    )>,
    pub grads: Vec<(Segment, usize, G)>,
    /// `(seq, head, dh0)`.
    pub dh0: Vec<(usize, usize, Array2<T>)>,
    pub diags: Vec<RankDiag<T>>,
}

/// CP backward over `plan` (the loss's upstream gradients live in `local`);
/// with `with_outputs` each piece's backward also returns its forward.
fn run_backward<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    plan: &Plan,
    opt: &CpOptions,
    with_outputs: bool,
) -> CpBackward<T, HeadGrads<T, E>> {
    let (kd, vd) = local.state_dims();
    let heads = local.heads();
    let fwd_diags = merged_states(local, plan, opt);
    let merged_fwd: Vec<Option<Vec<Array2<T>>>> =
        fwd_diags.iter().map(|d| d.merged_h0.clone()).collect();
    let zero = Array2::<T>::zeros((kd, vd));
    // dS_ext and M of each continuing rank's first piece.
    let first = par_pairs(plan.world(), heads, |r, h| {
        let rm = &plan.ranks[r];
        rm.continues().then(|| {
            let seg = rm.pieces[0];
            // From the merged state the forward used: dS_ext does not depend
            // on it for outputs linear in the state (the delta rules), but it
            // does for conv1d's SiLU.
            let h0 = merged_fwd[r]
                .as_ref()
                .map_or_else(|| zero.clone(), |m| m[h].clone());
            let mut ds_ext = match opt.faults.bwd_preprocess_head0_decay {
                Some(bt) => head0_decay_ds_ext(local, &seg, h, bt),
                None => local.backward(&seg, h, h0.view(), zero.view()).1,
            };
            opt.policy.round(Stage::SExt, &mut ds_ext);
            (ds_ext, transition(local, &seg, h, &opt.faults))
        })
    });
    let first_of = |r: usize, h: usize| first[r * heads + h].as_ref();
    // Reverse merge: the dht of each continued rank's last piece.
    let merged_dht: Vec<Option<Vec<Array2<T>>>> = plan
        .ranks
        .iter()
        .map(|rm| {
            rm.continued().then(|| {
                if opt.faults.carry_dropped || opt.faults.carry_grad_dropped {
                    return vec![zero.clone(); heads];
                }
                let seq = rm.pieces.last().expect("non-empty").seq;
                (0..heads)
                    .map(|h| {
                        let mut ds = local.dht(seq, h).unwrap_or_else(|| zero.clone());
                        for j in (rm.rank + 1..=rm.rank + rm.post_num_ranks).rev() {
                            let (ds_ext, m) = first_of(j, h).expect("continuing rank");
                            let mut mds = gemm::dot(m.t(), ds.view());
                            opt.policy.round(Stage::MChain, &mut mds);
                            ds = mds + ds_ext;
                        }
                        opt.policy.round(Stage::Merged, &mut ds);
                        ds
                    })
                    .collect()
            })
        })
        .collect();
    // The table's reference backward runs before the pieces' backward, not
    // after it: the pieces' gradients are not live yet.
    let wanted = |rm: &RankMeta| rm.continued() && !opt.skip_reference_runs;
    let requests: Vec<(usize, usize)> = plan
        .ranks
        .iter()
        .filter(|rm| wanted(rm))
        .map(|rm| (rm.pieces.last().expect("non-empty").seq, rm.end))
        .collect();
    let mut references = reference_dhts(local, plan, &requests).into_iter();
    let mut reference_dhts: Vec<Option<Vec<Array2<T>>>> = plan
        .ranks
        .iter()
        .map(|rm| wanted(rm).then(|| references.next().expect("one per request")))
        .collect();
    let ps = pieces(plan);
    let segs = computed_segments(plan, &ps, &opt.faults);
    let runs = par_pairs(ps.len(), heads, |i, h| {
        let (p, seg) = (&ps[i], &segs[i]);
        let rm = &plan.ranks[p.rank];
        let h0 = piece_h0(local, plan, p, h, &merged_fwd);
        // The backward's recompute reads a stale state under the late expand.
        let stale = stale_h0(opt, p, h, &merged_fwd);
        let dht = if p.last && rm.continued() {
            merged_dht[p.rank].as_ref().expect("merged")[h].clone()
        } else if p.seg.end == seq_bounds(plan, p.seg.seq).1 {
            local.dht(p.seg.seq, h).unwrap_or_else(|| zero.clone())
        } else {
            zero.clone()
        };
        // Fault 4 leaves the forward intact and recomputes the backward from zeros.
        if opt.faults.drop_merged_state_in_backward && p.first && rm.continues() {
            let f = with_outputs.then(|| local.forward(seg, h, h0.view()));
            let (g, d) = local.backward(seg, h, zero.view(), dht.view());
            (f, g, d)
        } else if let Some(stale) = stale {
            let f = with_outputs.then(|| local.forward(seg, h, h0.view()));
            let (g, d) = local.backward(seg, h, stale.view(), dht.view());
            (f, g, d)
        } else if with_outputs {
            let (f, g, d) = local.forward_backward(seg, h, h0.view(), dht.view());
            (Some(f), g, d)
        } else {
            let (g, d) = local.backward(seg, h, h0.view(), dht.view());
            (None, g, d)
        }
    });
    let mut grads = Vec::with_capacity(runs.len());
    let mut dh0 = vec![];
    let mut fwd_runs = Vec::with_capacity(if with_outputs { runs.len() } else { 0 });
    for (i, (f, g, d)) in runs.into_iter().enumerate() {
        fwd_runs.extend(f);
        let (p, h) = (&ps[i / heads], i % heads);
        if p.seg.start == seq_bounds(plan, p.seg.seq).0 {
            dh0.push((p.seg.seq, h, d));
        }
        grads.push((segs[i / heads], h, g));
    }
    let outputs = with_outputs.then(|| piece_outputs(plan, &ps, &segs, heads, fwd_runs));
    let mut diags = fwd_diags;
    for (r, d) in diags.iter_mut().enumerate() {
        let rm = &plan.ranks[r];
        if rm.continues() {
            d.ds_ext = Some(
                (0..heads)
                    .map(|h| first_of(r, h).expect("continuing").0.clone())
                    .collect(),
            );
            d.m_first = Some(
                (0..heads)
                    .map(|h| first_of(r, h).expect("continuing").1.clone())
                    .collect(),
            );
        }
        d.merged_dht = merged_dht[r].clone();
        d.reference_dht = reference_dhts[r].take();
    }
    CpBackward {
        outputs,
        grads,
        dh0,
        diags,
    }
}

/// The non-CP gradients of the state leaving token `at − 1` of sequence
/// `seq`, one `[heads]` list per request `(seq, at)`: per sequence and head
/// one backward from the global `dht` over the tokens from the first request
/// on, run piece by piece between the requested tokens (as
/// [`reference_states`], in reverse). Each piece runs from the non-CP
/// state entering it (its request's token): the delta rules' state gradient
/// does not depend on the state, but conv1d's with SiLU does (the
/// activation's slope depends on the carried tokens), and a piece run from
/// zero gives the table a wrong reference there.
fn reference_dhts<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    plan: &Plan,
    requests: &[(usize, usize)],
) -> Vec<Vec<Array2<T>>> {
    let (kd, vd) = local.state_dims();
    let zero = Array2::zeros((kd, vd));
    // A backward piece starts at its own request's token `at`.
    let starts = reference_states(local, plan, requests);
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| (requests[i].0, std::cmp::Reverse(requests[i].1)));
    chained(
        requests,
        &order,
        local.heads(),
        |seq, h| {
            let dht = local.dht(seq, h).unwrap_or_else(|| zero.clone());
            (seq_bounds(plan, seq).1, dht)
        },
        |i, h, piece, dht| local.backward(piece, h, starts[i][h].view(), dht.view()).1,
    )
}

/// Refuses a fault that reads a per-channel decay on an operator without one.
fn check_faults<T: Scalar, E: Engine<T>>(
    p: &<E::Op as Operator<T>>::Prepared<'_>,
    faults: &Faults,
) -> Result<()> {
    let empty = Segment {
        seq: 0,
        batch: 0,
        start: 0,
        end: 0,
    };
    if faults.needs_decay() && E::Op::decay_log_sum(p, &empty, 0).is_none() {
        return Err(crate::error::Error::option(
            "precision",
            format!(
                "this fault misreads a per-channel gate `gk`, which {} has none of \
                 (it applies to kda, gdn2 and dplr)",
                <E::Op as OpSpec>::NAME
            ),
        ));
    }
    Ok(())
}

/// `seg` cut into chunks of `bt` tokens from its start (FLA's chunks of a
/// local sequence), in order.
fn chunks_of(seg: &Segment, bt: usize) -> Vec<Segment> {
    (seg.start..seg.end)
        .step_by(bt.max(1))
        .map(|start| Segment {
            start,
            end: (start + bt).min(seg.end),
            ..*seg
        })
        .collect()
}

/// `Diag(e^{decay})` of `seg` for head `h`, `[K]` (the operator has a
/// per-channel gate: [`check_faults`]).
fn diag_decay<T: Scalar, E: Engine<T>>(local: &Local<T, E>, seg: &Segment, h: usize) -> Vec<T> {
    E::Op::decay_log_sum(local.p, seg, h)
        .expect("checked: a per-channel gate")
        .iter()
        .map(|&x| x.exp())
        .collect()
}

/// `M [K, K]` of `seg` as the pre-process forms it: the engine's transition,
/// or under [`Faults::transition_low_rank_negated`] the product over the
/// piece's chunks of `Diag(γ_c) − L_c` where the chunk's transition is
/// `M_c = Diag(γ_c) + L_c`, i.e. `2·Diag(γ_c) − M_c`.
fn transition<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    seg: &Segment,
    h: usize,
    faults: &Faults,
) -> Array2<T> {
    let Some(bt) = faults.transition_low_rank_negated else {
        return local.transition(seg, h);
    };
    let kd = local.state_dims().0;
    let mut m = Array2::<T>::eye(kd);
    for c in chunks_of(seg, bt) {
        let mut flipped = local.transition(&c, h).mapv(|x| -x);
        for (d, g) in diag_decay(local, &c, h).into_iter().enumerate() {
            flipped[[d, d]] += g + g;
        }
        m = gemm::dot(flipped.view(), m.view());
    }
    m
}

/// `dS_ext` of `seg` (zero `dht`) as FLA #781's backward pre-process forms
/// it: chunk by chunk from the end, `dS ← B_c(dS)`, each chunk's exact map
/// `B_c(X) = Diag(γ_c)·X + (the chunk's own reads of the state)` (the
/// engine's backward over the chunk with `dht = X`), with its decay term
/// taken from head 0: `B_c(X) + (Diag(γ⁰_c) − Diag(γ_c))·X`. The state
/// gradient of these operators does not depend on the state, so each chunk
/// runs from a zero state.
fn head0_decay_ds_ext<T: Scalar, E: Engine<T>>(
    local: &Local<T, E>,
    seg: &Segment,
    h: usize,
    bt: usize,
) -> Array2<T> {
    let (kd, vd) = local.state_dims();
    let zero = Array2::<T>::zeros((kd, vd));
    let mut ds = zero.clone();
    for c in chunks_of(seg, bt).iter().rev() {
        let mut next = local.backward(c, h, zero.view(), ds.view()).1;
        let (own, head0) = (diag_decay(local, c, h), diag_decay(local, c, 0));
        for d in 0..kd {
            let wrong = head0[d] - own[d];
            for v in 0..vd {
                next[[d, v]] += wrong * ds[[d, v]];
            }
        }
        ds = next;
    }
    ds
}

/// The tokens each piece computes: all of them, or under
/// [`Faults::stale_chunk_indices`] the prefix that the chunk indices of the
/// global `cu_seqlens` cover (local sequence `i` gets as many chunks as
/// global sequence `i` has).
fn computed_segments(plan: &Plan, ps: &[PieceRef], faults: &Faults) -> Vec<Segment> {
    let Some(bt) = faults.stale_chunk_indices else {
        return ps.iter().map(|p| p.seg).collect();
    };
    let global_chunks = |i: usize| {
        plan.cu_seqlens
            .get(i + 1)
            .map_or(0, |&end| (end - plan.cu_seqlens[i]) as usize)
            .div_ceil(bt.max(1))
    };
    ps.iter()
        .map(|p| Segment {
            end: p.seg.end.min(p.seg.start + global_chunks(p.local) * bt),
            ..p.seg
        })
        .collect()
}
