//! KDA forward intermediates under FLA's names and layouts (fla-core 0.6.0,
//! `chunk_kda_fwd` with `disable_recompute=True`), so a port can check each
//! sub-function, and where a port's intermediates leave the band.
//!
//! | name | layout | what |
//! |---|---|---|
//! | `g_cumsum` | `[B, T, HV, K]` | in-chunk cumulative log-decay **in base 2** (`Γ·log2 e`, FLA's `chunk_local_cumsum(g, scale=RCP_LN2)`; `chunk_kda` calls it `g_cumsum`, the input `g` keeps its name) |
//! | `Aqk` | `[B, T, HV, BT]` | row = token, column = key position inside its chunk; `scale·Σ q k exp(Γ_r − Γ_c)`, `c ≤ r`, 0 above |
//! | `Akk` | `[B, T, HV, BT]` | `(I + L)^{-1}`, unit lower triangular, 0 above (β is applied in `w`, `u`) |
//! | `w`, `kg`, `qg` | `[B, T, HV, K]` | `Akk Diag(β)(exp(Γ)⊙K)`; `K⊙exp(Γ_C − Γ)`; `Q⊙exp(Γ)` (q unscaled, as FLA) |
//! | `u`, `v_new` | `[B, T, HV, V]` | `Akk Diag(β) V`; `u − w h` |
//! | `h` | `[B, NT, HV, K, V]` | state entering each chunk; chunks numbered along T (varlen: over all sequences) |
//! | `S_ext`, `M` | `[R, HV, K, V]`, `[R, HV, K, K]` | CP: each rank's pre-process of its last local sequence |
//! | `merged_initial_state` | `[R, HV, K, V]` | CP: merged initial state of each rank's first sequence (0 when it does not continue) |
//! | `merged_dht` | `[R, HV, K, V]` | CP: merged `dht` of each rank's last sequence (0 when it is not continued) |
//!
//! `BT` is the chunk size. Under CP the per-token and per-chunk tensors are
//! every rank's local tensors laid end to end along T: chunks restart at
//! rank cuts as well as sequence starts.

use deltaref::cp::RankDiag;
use deltaref::kda;
use deltaref::kda::chunk::Chunk;
use deltaref::op::{self, Operator as _};
use deltaref::varlen::{par_pairs, Segment};
use ndarray::{s, Array2, ArrayD, IxDyn};
use serde::Serialize;

pub use crate::case::{is_intermediate, INTERMEDIATE_NAMES as NAMES};
use crate::case::{Case, CaseError, Inputs, Op};
use crate::impls::{Device, Engine, Impl};
use crate::metrics;
use crate::outputs::Tensors;

/// The per-rank CP intermediates (leading rank index).
const PER_RANK: [&str; 4] = ["S_ext", "M", "merged_initial_state", "merged_dht"];

/// One chunk's place: batch row, tokens `[start, end)`, its index along
/// `h`'s NT axis, and the CP rank holding it (0 without CP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ChunkPos {
    pub batch: usize,
    pub start: usize,
    pub end: usize,
    pub index: usize,
    pub rank: usize,
}

/// The chunks of `pieces` (each a `(rank, segment)`), numbered along T.
fn chunk_positions(pieces: &[(usize, Segment)], c: usize) -> Vec<ChunkPos> {
    let mut next = vec![0usize; pieces.iter().map(|p| p.1.batch + 1).max().unwrap_or(0)];
    let mut out = vec![];
    for &(rank, seg) in pieces {
        for start in (seg.start..seg.end).step_by(c) {
            out.push(ChunkPos {
                batch: seg.batch,
                start,
                end: (start + c).min(seg.end),
                index: next[seg.batch],
                rank,
            });
            next[seg.batch] += 1;
        }
    }
    out
}

fn usage(m: &str) -> CaseError {
    CaseError::Usage(m.into())
}

/// Computes the oracle's intermediates of `case` with `imp` (the chunked
/// engine, with or without CP, on the CPU, in f64; a preset's storage
/// rounding applies). Returns the tensors and the chunk layout.
pub fn compute(case: &Case, imp: &Impl) -> Result<(Tensors, Vec<ChunkPos>), CaseError> {
    let path = "(case)";
    let invalid = |e: deltaref::Error| CaseError::Invalid {
        path: path.into(),
        source: e,
    };
    if case.meta.op != Op::Kda {
        return Err(usage(
            "intermediates are defined for KDA (FLA's chunk_kda_fwd): this case is not kda",
        ));
    }
    let Engine::Chunk(c) = imp.engine else {
        return Err(usage(
            "intermediates come from the chunked form: use --impl chunk or cp (with --cp-engine chunk)",
        ));
    };
    if imp.device != Device::Cpu {
        return Err(usage(
            "intermediates are the oracle's (CPU): use --impl chunk or cp",
        ));
    }
    let rounded;
    let case = match imp.policy.storage(deltaref::precision::Stage::Inputs) {
        Some(st) => {
            rounded = case.with_rounded_inputs(|x| st.round_f64(x));
            &rounded
        }
        None => case,
    };
    let Inputs::Kda(x) = case.inputs().map_err(invalid)? else {
        unreachable!("op checked above")
    };
    let opts = case.meta.kda_options();
    let p = kda::Prepared::new(&x, &opts)
        .map_err(invalid)?
        .with_stored_activations(&imp.policy);
    let engine = Chunk::new(c)
        .map_err(invalid)?
        .with_policy(imp.policy.clone());
    let (pieces, diags) = match &imp.cp {
        None => (
            p.segments.iter().map(|&s| (0, s)).collect::<Vec<_>>(),
            vec![],
        ),
        Some((spec, _)) => {
            let plan = spec
                .build(p.dims.b, p.dims.t, x.cu_seqlens.as_deref())
                .map_err(invalid)?;
            let diags = imp.compute_with_diags(case).map_err(invalid)?.1;
            let pieces = plan
                .ranks
                .iter()
                .flat_map(|r| r.pieces.iter().map(move |&s| (r.rank, s)))
                .collect();
            (pieces, diags)
        }
    };
    let tensors = fill(&p, &engine, &pieces, &diags, c);
    Ok((tensors, chunk_positions(&pieces, c)))
}

/// The initial state a CP piece runs from (merged, its sequence's own, or zeros).
fn piece_h0(
    p: &kda::Prepared<f64>,
    pieces: &[(usize, Segment)],
    diags: &[RankDiag<f64>],
    i: usize,
    h: usize,
) -> ndarray::Array2<f64> {
    let (rank, seg) = pieces[i];
    let first_of_rank = i == 0 || pieces[i - 1].0 != rank;
    match diags.get(rank).and_then(|d| d.merged_h0.as_ref()) {
        Some(m) if first_of_rank => m[h].clone(),
        _ if p
            .segments
            .iter()
            .any(|s| s.seq == seg.seq && s.start == seg.start) =>
        {
            op::initial_state(p, seg.seq, h)
        }
        _ => ndarray::Array2::zeros((p.dims.k, p.dims.v)),
    }
}

fn fill(
    p: &kda::Prepared<f64>,
    engine: &Chunk,
    pieces: &[(usize, Segment)],
    diags: &[RankDiag<f64>],
    c: usize,
) -> Tensors {
    let d = &p.dims;
    let (b, t, hv, k, v) = (d.b, d.t, d.hv, d.k, d.v);
    let chunks = chunk_positions(pieces, c);
    let nt = chunks.iter().map(|ch| ch.index + 1).max().unwrap_or(0);
    let z = |shape: &[usize]| ArrayD::<f64>::zeros(IxDyn(shape));
    let mut out: Tensors = [
        ("g_cumsum", z(&[b, t, hv, k])),
        ("Aqk", z(&[b, t, hv, c])),
        ("Akk", z(&[b, t, hv, c])),
        ("w", z(&[b, t, hv, k])),
        ("u", z(&[b, t, hv, v])),
        ("qg", z(&[b, t, hv, k])),
        ("kg", z(&[b, t, hv, k])),
        ("v_new", z(&[b, t, hv, v])),
        ("h", z(&[b, nt, hv, k, v])),
    ]
    .into_iter()
    .map(|(n, a)| (n.to_string(), a))
    .collect();
    let runs = par_pairs(pieces.len(), hv, |i, h| {
        let h0 = piece_h0(p, pieces, diags, i, h);
        engine.forward_intermediates(&kda::Kda::head(p, &pieces[i].1, h), h0.view())
    });
    let log2e = std::f64::consts::LOG2_E;
    for (i, f) in runs.iter().enumerate() {
        let (seg, h) = (pieces[i / hv].1, i % hv);
        let first = chunks
            .iter()
            .position(|ch| ch.batch == seg.batch && ch.start == seg.start)
            .unwrap_or(0);
        for (n, ch) in f.intra.iter().enumerate() {
            let a = seg.start + ch.start;
            let rows = s![seg.batch, a..a + ch.len(), h, ..];
            let cols = s![seg.batch, a..a + ch.len(), h, ..ch.len()];
            let put = |out: &mut Tensors, name: &str, sl, val: ndarray::ArrayView2<f64>| {
                out.get_mut(name)
                    .expect("allocated")
                    .slice_mut(sl)
                    .assign(&val);
            };
            put(
                &mut out,
                "g_cumsum",
                rows,
                ch.g_cumsum.mapv(|g| g * log2e).view(),
            );
            put(&mut out, "Aqk", cols, ch.aqk.view());
            put(&mut out, "Akk", cols, ch.n_inv.view());
            put(&mut out, "w", rows, ch.w.view());
            put(&mut out, "u", rows, ch.u.view());
            put(&mut out, "qg", rows, ch.qg.mapv(|q| q / p.scale).view());
            put(&mut out, "kg", rows, ch.kg.view());
            let vn = f.v_new.slice(s![ch.start..ch.start + ch.len(), ..]);
            put(&mut out, "v_new", rows, vn);
            let idx = chunks[first + n].index;
            out.get_mut("h")
                .expect("allocated")
                .slice_mut(s![seg.batch, idx, h, .., ..])
                .assign(&f.h.index_axis(ndarray::Axis(0), n));
        }
    }
    if !diags.is_empty() {
        let per_rank = |f: fn(&RankDiag<f64>) -> Option<&[Array2<f64>]>| {
            diags.iter().map(f).collect::<Vec<_>>()
        };
        out.insert(
            "S_ext".into(),
            stack(&per_rank(|d| Some(&d.s_ext)), [hv, k, v]),
        );
        out.insert("M".into(), stack(&per_rank(|d| Some(&d.m)), [hv, k, k]));
        out.insert(
            "merged_initial_state".into(),
            stack(&per_rank(|d| d.merged_h0.as_deref()), [hv, k, v]),
        );
        out.insert(
            "merged_dht".into(),
            stack(&per_rank(|d| d.merged_dht.as_deref()), [hv, k, v]),
        );
    }
    out
}

/// `[R, HV, K, cols]` from per-rank, per-head matrices (zeros where a rank has none).
fn stack(per_rank: &[Option<&[Array2<f64>]>], [hv, k, cols]: [usize; 3]) -> ArrayD<f64> {
    let mut a = ArrayD::zeros(IxDyn(&[per_rank.len(), hv, k, cols]));
    for (r, m) in per_rank.iter().enumerate() {
        for (h, m) in m.iter().flat_map(|m| m.iter()).enumerate() {
            a.slice_mut(s![r, h, .., ..]).assign(m);
        }
    }
    a
}

/// One intermediate's comparison: whole-tensor numbers and the first chunk
/// (or rank, for per-rank tensors) whose error leaves the band.
#[derive(Clone, Debug, Serialize)]
pub struct IntermediateRow {
    pub tensor: String,
    pub shape: Vec<usize>,
    pub norm_ratio: Option<f64>,
    pub max_abs: Option<f64>,
    pub pass: bool,
    /// Where the error first leaves the band, in words.
    pub first_bad: Option<String>,
    pub problem: Option<String>,
}

/// `rms(diff over the group) / scale`, with `scale = rms(whole reference) + 1e-8`, as `diagnose`.
fn group_error(
    r: &ArrayD<f64>,
    c: &ArrayD<f64>,
    idx: &[ndarray::SliceInfoElem],
    scale: f64,
) -> f64 {
    let (rs, cs) = (r.slice(idx), c.slice(idx));
    let n = rs.len().max(1) as f64;
    let diff = rs
        .iter()
        .zip(cs.iter())
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>();
    (diff / n).sqrt() / scale
}

/// Compares every intermediate the candidate holds with the oracle's.
pub fn compare(
    oracle: &Tensors,
    candidate: &Tensors,
    chunks: &[ChunkPos],
    max_ratio: f64,
) -> Vec<IntermediateRow> {
    use ndarray::SliceInfoElem as E;
    let all = E::Slice {
        start: 0,
        end: None,
        step: 1,
    };
    let range = |a: usize, b: usize| E::Slice {
        start: a as isize,
        end: Some(b as isize),
        step: 1,
    };
    candidate
        .iter()
        .map(|(name, c)| {
            let base = IntermediateRow {
                tensor: name.clone(),
                shape: c.shape().to_vec(),
                norm_ratio: None,
                max_abs: None,
                pass: false,
                first_bad: None,
                problem: None,
            };
            let Some(r) = oracle.get(name) else {
                return IntermediateRow {
                    problem: Some(
                        "the oracle has no such intermediate for this case (CP tensors need a CP case)"
                            .into(),
                    ),
                    ..base
                };
            };
            if r.shape() != c.shape() {
                return IntermediateRow {
                    problem: Some(format!("shape {:?}, expected {:?}", c.shape(), r.shape())),
                    ..base
                };
            }
            let (rf, cf): (Vec<f64>, Vec<f64>) =
                (r.iter().copied().collect(), c.iter().copied().collect());
            let cmp = metrics::compare(&rf, &cf, max_ratio);
            let scale = (rf.iter().map(|x| x * x).sum::<f64>() / rf.len().max(1) as f64).sqrt() + 1e-8;
            let bad = |e: f64| e > max_ratio || e.is_nan();
            let first_bad = if PER_RANK.contains(&name.as_str()) {
                (0..r.shape()[0])
                    .find(|&i| {
                        let mut idx = vec![range(i, i + 1)];
                        idx.extend(std::iter::repeat_n(all, r.ndim() - 1));
                        bad(group_error(r, c, &idx, scale))
                    })
                    .map(|i| format!("rank {i}"))
            } else {
                chunks
                    .iter()
                    .find(|ch| {
                        let along = if name == "h" {
                            range(ch.index, ch.index + 1)
                        } else {
                            range(ch.start, ch.end)
                        };
                        let mut idx = vec![range(ch.batch, ch.batch + 1), along];
                        idx.extend(std::iter::repeat_n(all, r.ndim() - 2));
                        bad(group_error(r, c, &idx, scale))
                    })
                    .map(|ch| {
                        format!(
                            "chunk {} (batch {}, tokens {}..{}, rank {})",
                            ch.index, ch.batch, ch.start, ch.end, ch.rank
                        )
                    })
            };
            let finite = cf.iter().all(|v| v.is_finite());
            IntermediateRow {
                norm_ratio: Some(cmp.norm_ratio),
                max_abs: Some(cmp.max_abs),
                pass: finite && cmp.pass,
                first_bad,
                problem: (!finite).then(|| "non-finite values in the candidate".into()),
                ..base
            }
        })
        .collect()
}
