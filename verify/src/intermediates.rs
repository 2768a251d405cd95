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

pub use deltaref::registry::ChunkPos;
use ndarray::ArrayD;
use serde::Serialize;

pub use crate::case::is_intermediate;
use crate::case::{Case, CaseError};
use crate::impls::{Compute, Device, Impl};
use crate::metrics;
use crate::outputs::Tensors;

/// The per-rank CP intermediates (leading rank index).
const PER_RANK: [&str; 4] = ["S_ext", "M", "merged_initial_state", "merged_dht"];

fn usage(m: &str) -> CaseError {
    CaseError::Usage(m.into())
}

/// Computes the oracle's intermediates of `case` with `imp` (the chunked
/// engine, with or without CP, on the CPU, in `compute`; a preset's
/// storage rounding applies). Returns the tensors and the chunk layout.
pub fn compute(
    case: &Case,
    imp: &Impl,
    compute: Compute,
) -> Result<(Tensors, Vec<ChunkPos>), CaseError> {
    if case.meta.op.info().intermediates.is_empty() {
        return Err(CaseError::Usage(format!(
            "intermediates are defined for ops whose FLA kernels store them (kda: chunk_kda_fwd): \
             this case is {}",
            case.meta.op.name()
        )));
    }
    if imp.device != Device::Cpu {
        return Err(usage(
            "intermediates are the oracle's (CPU): use --impl chunk or cp",
        ));
    }
    let invalid = |e: deltaref::Error| CaseError::Invalid {
        path: "(case)".into(),
        source: e,
    };
    imp.intermediates(case, compute).map_err(invalid)
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
