//! Error localisation: where along T an error starts. For every per-token
//! tensor (`[B, T, …]`) the error is broken down per token, per sequence, per
//! CP rank and per chunk, and the first token whose error leaves the noise
//! band is named with its sequence, rank and chunk. Errors are measured on
//! the whole tensor's scale — `rms(diff over the group) / (rms(ref) + 1e-8)` —
//! so groups are comparable with each other and with the tensor's norm_ratio.

use std::fmt;

use ndarray::ArrayD;
use serde::Serialize;

use crate::metrics::{max_abs, norm_ratio};
use crate::outputs::Tensors;

/// Where tokens sit: sequences (varlen or batch rows), CP ranks, chunks.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenMap {
    /// Batch rows and tokens per row.
    pub b: usize,
    pub t: usize,
    /// Per sequence: `(batch row, start, end)`.
    pub sequences: Vec<(usize, usize, usize)>,
    /// Rank boundaries along T, `[0, c_1, …, T]` (`[0, T]` without CP).
    pub rank_cuts: Vec<usize>,
    /// Chunks restart at every sequence start.
    pub chunk_size: usize,
}

/// A token's place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Location {
    pub batch: usize,
    pub token: usize,
    pub sequence: usize,
    pub rank: usize,
    /// Chunk index inside the sequence.
    pub chunk: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "token {} (batch {}, sequence {}, rank {}, chunk {} of its sequence)",
            self.token, self.batch, self.sequence, self.rank, self.chunk
        )
    }
}

impl TokenMap {
    /// `cu_seqlens` (validated elsewhere) or one sequence per batch row;
    /// `cuts` are the interior rank cut points.
    pub fn new(
        b: usize,
        t: usize,
        cu_seqlens: Option<&[i64]>,
        cuts: &[usize],
        chunk_size: usize,
    ) -> Self {
        let sequences = match cu_seqlens {
            Some(cu) => cu
                .windows(2)
                .map(|w| (0, w[0] as usize, w[1] as usize))
                .collect(),
            None => (0..b).map(|i| (i, 0, t)).collect(),
        };
        let rank_cuts = std::iter::once(0)
            .chain(cuts.iter().copied())
            .chain(std::iter::once(t))
            .collect();
        TokenMap {
            b,
            t,
            sequences,
            rank_cuts,
            chunk_size: chunk_size.max(1),
        }
    }

    pub fn locate(&self, batch: usize, token: usize) -> Location {
        let sequence = self
            .sequences
            .iter()
            .position(|&(bb, s, e)| bb == batch && s <= token && token < e)
            .unwrap_or(0);
        let start = self.sequences.get(sequence).map_or(0, |s| s.1);
        let rank = self
            .rank_cuts
            .windows(2)
            .position(|w| w[0] <= token && token < w[1])
            .unwrap_or(0);
        Location {
            batch,
            token,
            sequence,
            rank,
            chunk: (token - start) / self.chunk_size,
        }
    }

    fn ranks(&self) -> usize {
        self.rank_cuts.len() - 1
    }
}

/// The diagnosis of one tensor. `first_bad` is the first token of the first
/// chunk whose error exceeds the band.
#[derive(Clone, Debug, Serialize)]
pub struct TensorDiagnosis {
    pub name: String,
    pub shape: Vec<usize>,
    pub norm_ratio: f64,
    pub max_abs: f64,
    /// Per token (`B·T` values, row-major), for `[B, T, …]` tensors.
    pub per_token: Option<Vec<f64>>,
    pub per_sequence: Vec<f64>,
    pub per_rank: Vec<f64>,
    /// `(sequence, chunk, error)` for every chunk of every sequence.
    pub per_chunk: Vec<(usize, usize, f64)>,
    /// The band each of those chunks was judged against (the floor, or
    /// `NOISE_FACTOR ×` the noise reference's error there), same order.
    pub chunk_band: Vec<f64>,
    /// Where the error leaves the band (see the type's docs).
    pub first_bad: Option<Location>,
    /// Every separate stretch out of band: runs of consecutive chunks of
    /// one sequence whose error leaves the band, in token order.
    pub excursions: Vec<Excursion>,
    /// Error per column of the last (V) dimension, for tensors ending in V
    /// (`o`, `dv`, `final_state`, `dh0`): a merge covering only part of V
    /// shows as clean lower columns and bad upper ones.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_v_column: Vec<f64>,
}

/// One stretch of a sequence whose chunks leave the band: from `start`
/// (the first token out of band in its first chunk) to token `end`
/// (exclusive, the end of its last chunk), the largest chunk error in it
/// and the band there.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Excursion {
    pub start: Location,
    pub end: usize,
    pub chunks: usize,
    pub peak: f64,
    pub band: f64,
}

/// The diagnosis of a candidate against a reference.
#[derive(Clone, Debug, Serialize)]
pub struct Diagnosis {
    /// The band's floor (per-token error always allowed).
    pub band: f64,
    /// What set the band per chunk: `NOISE_FACTOR ×` that run's own error
    /// in the same chunk (None: the floor alone): the preset in backticks
    /// and, where the caller says, why it was chosen.
    pub noise_reference: Option<String>,
    pub map: TokenMap,
    pub tensors: Vec<TensorDiagnosis>,
    /// Earliest first-bad token over all tensors, with the tensor's name.
    pub first_bad: Option<(String, Location)>,
}

fn rms(x: impl Iterator<Item = f64>) -> (f64, usize) {
    let (s, n) = x.fold((0.0, 0usize), |(s, n), v| (s + v * v, n + 1));
    (if n == 0 { 0.0 } else { (s / n as f64).sqrt() }, n)
}

/// Is `x` per-token for this map (leading dims `[B, T]`)?
fn is_per_token(x: &ArrayD<f64>, map: &TokenMap) -> bool {
    x.ndim() >= 2 && x.shape()[0] == map.b && x.shape()[1] == map.t
}

/// A chunk's error may reach this multiple of the noise reference's own
/// error in the same chunk before it counts as a fault: rounding noise of
/// two runs of one precision differs by a small factor, a fault by orders.
pub const NOISE_FACTOR: f64 = 4.0;

/// The chunk-by-chunk band: `max(floor, NOISE_FACTOR × noise error of the
/// chunk)`, in the order `diagnose_tensor` visits chunks.
struct Band<'a> {
    floor: f64,
    noise: Option<&'a [(usize, usize, f64)]>,
}

impl Band<'_> {
    fn at(&self, i: usize) -> f64 {
        let n = self.noise.and_then(|n| n.get(i)).map_or(0.0, |x| x.2);
        self.floor.max(NOISE_FACTOR * n)
    }
}

/// Error per column of the last dimension, on the whole tensor's scale.
fn per_column(rf: &[f64], cf: &[f64], cols: usize) -> Vec<f64> {
    let scale = rms(rf.iter().copied()).0 + 1e-8;
    let rows = (rf.len() / cols.max(1)).max(1) as f64;
    (0..cols)
        .map(|j| {
            let s: f64 = rf
                .iter()
                .zip(cf)
                .skip(j)
                .step_by(cols)
                .map(|(a, b)| (a - b) * (a - b))
                .sum();
            (s / rows).sqrt() / scale
        })
        .collect()
}

fn diagnose_tensor(
    name: &str,
    r: &ArrayD<f64>,
    c: &ArrayD<f64>,
    map: &TokenMap,
    band: &Band,
    v_dim: Option<usize>,
) -> TensorDiagnosis {
    let (rf, cf): (Vec<f64>, Vec<f64>) = (r.iter().copied().collect(), c.iter().copied().collect());
    let mut d = TensorDiagnosis {
        name: name.to_string(),
        shape: r.shape().to_vec(),
        norm_ratio: norm_ratio(&rf, &cf),
        max_abs: max_abs(&rf, &cf).0,
        per_token: None,
        per_sequence: vec![],
        per_rank: vec![],
        per_chunk: vec![],
        chunk_band: vec![],
        first_bad: None,
        excursions: vec![],
        per_v_column: vec![],
    };
    let ends_in_v = ["o", "dv", "final_state", "dh0"].contains(&name);
    if let Some(v) = v_dim.filter(|&v| ends_in_v && v > 1 && r.shape().last() == Some(&v)) {
        d.per_v_column = per_column(&rf, &cf, v);
    }
    if !is_per_token(r, map) {
        return d;
    }
    let scale = rms(rf.iter().copied()).0 + 1e-8;
    let width = rf.len() / (map.b * map.t).max(1);
    // Sum of squared differences per token.
    let sq: Vec<f64> = rf
        .chunks(width.max(1))
        .zip(cf.chunks(width.max(1)))
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum())
        .collect();
    let group = |tokens: &mut dyn Iterator<Item = usize>| {
        let (s, n) = tokens.fold((0.0, 0usize), |(s, n), i| (s + sq[i], n + 1));
        if n == 0 {
            0.0
        } else {
            (s / (n * width) as f64).sqrt() / scale
        }
    };
    let per_token: Vec<f64> = (0..sq.len())
        .map(|i| group(&mut std::iter::once(i)))
        .collect();
    d.per_sequence = map
        .sequences
        .iter()
        .map(|&(b, s, e)| group(&mut (s..e).map(|t| b * map.t + t)))
        .collect();
    d.per_rank = (0..map.ranks())
        .map(|r| {
            let (s, e) = (map.rank_cuts[r], map.rank_cuts[r + 1]);
            group(&mut (0..map.b).flat_map(|b| (s..e).map(move |t| b * map.t + t)))
        })
        .collect();
    // The first chunk (in token order) whose error leaves the band; single
    // tokens are too noisy at bf16 to judge alone. Inside it, the first token
    // out of band (or the chunk's start).
    // Consecutive bad chunks of one sequence make one excursion.
    let mut first: Option<usize> = None;
    for (si, &(b, s, e)) in map.sequences.iter().enumerate() {
        let mut open = false;
        for (ci, cs) in (s..e).step_by(map.chunk_size).enumerate() {
            let ce = (cs + map.chunk_size).min(e);
            let err = group(&mut (cs..ce).map(|t| b * map.t + t));
            let limit = band.at(d.per_chunk.len());
            d.per_chunk.push((si, ci, err));
            d.chunk_band.push(limit);
            if !(err > limit || err.is_nan()) {
                open = false;
                continue;
            }
            let tok = (cs..ce)
                .find(|&t| per_token[b * map.t + t] > limit || per_token[b * map.t + t].is_nan())
                .unwrap_or(cs);
            let flat = b * map.t + tok;
            first = Some(first.map_or(flat, |f| f.min(flat)));
            match d.excursions.last_mut().filter(|_| open) {
                Some(x) => {
                    x.end = ce;
                    x.chunks += 1;
                    if err > x.peak || err.is_nan() {
                        (x.peak, x.band) = (err, limit);
                    }
                }
                None => d.excursions.push(Excursion {
                    start: map.locate(b, tok),
                    end: ce,
                    chunks: 1,
                    peak: err,
                    band: limit,
                }),
            }
            open = true;
        }
    }
    d.first_bad = first.map(|i| map.locate(i / map.t, i % map.t));
    d.per_token = Some(per_token);
    d
}

/// Diagnoses every tensor present in both maps against a fixed band.
pub fn diagnose(reference: &Tensors, candidate: &Tensors, map: &TokenMap, band: f64) -> Diagnosis {
    diagnose_with_noise(reference, candidate, None, map, band, None)
}

/// A run of the same case whose error is rounding noise only (e.g. the
/// preset with its fault switched off), and its name for the report.
pub struct NoiseReference<'a> {
    pub name: String,
    pub tensors: &'a Tensors,
}

/// Diagnoses every tensor present in both maps. With `noise`, each chunk's
/// band is `max(floor, NOISE_FACTOR ×` the noise run's error in that chunk`)`,
/// so bf16 rounding noise (largest at sequence ends) is not taken for a
/// fault. `v_dim`: report the error per V column of tensors ending in V.
pub fn diagnose_with_noise(
    reference: &Tensors,
    candidate: &Tensors,
    noise: Option<NoiseReference>,
    map: &TokenMap,
    floor: f64,
    v_dim: Option<usize>,
) -> Diagnosis {
    let tensors: Vec<TensorDiagnosis> = reference
        .iter()
        .filter_map(|(name, r)| {
            let c = candidate.get(name).filter(|c| c.shape() == r.shape())?;
            let noise_chunks = noise
                .as_ref()
                .and_then(|n| n.tensors.get(name))
                .filter(|n| n.shape() == r.shape())
                .map(|n| {
                    let free = Band { floor, noise: None };
                    diagnose_tensor(name, r, n, map, &free, None).per_chunk
                });
            let band = Band {
                floor,
                noise: noise_chunks.as_deref(),
            };
            Some(diagnose_tensor(name, r, c, map, &band, v_dim))
        })
        .collect();
    let first_bad = tensors
        .iter()
        .filter_map(|t| t.first_bad.map(|l| (t.name.clone(), l)))
        .min_by_key(|(_, l)| (l.batch, l.token));
    Diagnosis {
        band: floor,
        noise_reference: noise.map(|n| n.name),
        map: map.clone(),
        tensors,
        first_bad,
    }
}

impl fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.noise_reference {
            None => writeln!(
                f,
                "noise band: per-token error > {:.1e} counts as leaving it",
                self.band
            )?,
            Some(n) => writeln!(
                f,
                "noise band per chunk: {NOISE_FACTOR}× the error of {n} (rounding noise only) in the same chunk, at least {:.1e}",
                self.band
            )?,
        }
        writeln!(
            f,
            "{:<12} {:<18} {:>11} {:>11}  {:<28} per rank",
            "tensor", "shape", "norm_ratio", "max_abs", "first token out of band"
        )?;
        for t in &self.tensors {
            let first = t.first_bad.map_or("-".to_string(), |l| {
                format!(
                    "t={} seq {} rank {} chunk {}",
                    l.token, l.sequence, l.rank, l.chunk
                )
            });
            let ranks: Vec<String> = t.per_rank.iter().map(|e| format!("{e:.2e}")).collect();
            writeln!(
                f,
                "{:<12} {:<18} {:>11.3e} {:>11.3e}  {:<28} {}",
                t.name,
                format!("{:?}", t.shape),
                t.norm_ratio,
                t.max_abs,
                first,
                ranks.join(" ")
            )?;
        }
        for t in self.tensors.iter().filter(|t| !t.per_v_column.is_empty()) {
            writeln!(f, "{}", v_columns(t))?;
        }
        for t in self.tensors.iter().filter(|t| !t.excursions.is_empty()) {
            writeln!(
                f,
                "`{}` leaves the band in {} place(s):",
                t.name,
                t.excursions.len()
            )?;
            for x in &t.excursions {
                let l = x.start;
                writeln!(
                    f,
                    "  sequence {} (batch {}): tokens {}..{} (rank {}, chunk {} on, {} chunk(s)), \
                     peak chunk error {:.2e} against a band of {:.2e}",
                    l.sequence, l.batch, l.token, x.end, l.rank, l.chunk, x.chunks, x.peak, x.band
                )?;
            }
        }
        match &self.first_bad {
            Some((name, l)) => write!(f, "error starts at {l}, in `{name}`"),
            None => write!(f, "no per-token tensor leaves the noise band"),
        }
    }
}

impl TensorDiagnosis {
    /// The band each token was judged against (its chunk's), `B·T` values
    /// row-major like `per_token`; tokens outside every sequence get the
    /// smallest band. None for a tensor that is not per-token.
    pub fn band_per_token(&self, map: &TokenMap) -> Option<Vec<f64>> {
        self.per_token.as_ref()?;
        let low = self
            .chunk_band
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let mut out = vec![if low.is_finite() { low } else { 0.0 }; map.b * map.t];
        let mut i = 0;
        for &(b, s, e) in &map.sequences {
            for cs in (s..e).step_by(map.chunk_size) {
                let ce = (cs + map.chunk_size).min(e);
                let band = self.chunk_band.get(i).copied().unwrap_or(low);
                out[b * map.t + cs..b * map.t + ce].fill(band);
                i += 1;
            }
        }
        Some(out)
    }
}

/// One line: a tensor's error per V column, its lower and upper halves,
/// and the partial-V merge signature when the upper half dominates.
fn v_columns(t: &TensorDiagnosis) -> String {
    let p = &t.per_v_column;
    let half = p.len() / 2;
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len().max(1) as f64;
    let (lo, hi) = (mean(&p[..half]), mean(&p[half..]));
    let cols: Vec<String> = p.iter().map(|e| format!("{e:.1e}")).collect();
    let shown = if cols.len() > 16 {
        format!(
            "{} … {}",
            cols[..8].join(" "),
            cols[cols.len() - 8..].join(" ")
        )
    } else {
        cols.join(" ")
    };
    let sig = if hi > 10.0 * lo && hi > 0.0 {
        "  <- upper half of V only: a merge covering part of V (stale block size)"
    } else {
        ""
    };
    format!(
        "{:<12} per V column: {shown}  (lower half {lo:.2e}, upper half {hi:.2e}){sig}",
        t.name
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::IxDyn;

    fn tensors(name: &str, x: ArrayD<f64>) -> Tensors {
        Tensors::from([(name.to_string(), x)])
    }

    #[test]
    fn locates_the_first_token_out_of_band() {
        // Two sequences [0,10) and [10,24), ranks cut at 12, chunk 4.
        let map = TokenMap::new(1, 24, Some(&[0, 10, 24]), &[12], 4);
        let r = ArrayD::from_shape_fn(IxDyn(&[1, 24, 2]), |i| {
            1.0 + i[1] as f64 * 0.1 + i[2] as f64
        });
        let mut c = r.clone();
        for t in 17..24 {
            c[[0, t, 0]] += 0.5;
        }
        let d = diagnose(&tensors("o", r), &tensors("o", c), &map, 1e-3);
        let first = d.tensors[0].first_bad.expect("error injected");
        assert_eq!(
            first,
            Location {
                batch: 0,
                token: 17,
                sequence: 1,
                rank: 1,
                chunk: 1
            }
        );
        assert_eq!(d.tensors[0].per_rank[0], 0.0);
        assert!(d.tensors[0].per_rank[1] > 0.0);
        assert_eq!(d.tensors[0].per_sequence[0], 0.0);
        // Chunk (seq 1, chunk 0) = tokens 10..14 is clean, (1, 1) = 14..18 is not.
        let chunk = |s, c| {
            d.tensors[0]
                .per_chunk
                .iter()
                .find(|x| x.0 == s && x.1 == c)
                .expect("chunk")
                .2
        };
        assert_eq!(chunk(1, 0), 0.0);
        assert!(chunk(1, 1) > 0.0);
        assert_eq!(d.first_bad.as_ref().map(|f| f.0.as_str()), Some("o"));
    }

    #[test]
    fn per_token_errors_square_sum_to_the_norm_ratio() {
        let map = TokenMap::new(2, 5, None, &[], 2);
        let r = ArrayD::from_shape_fn(IxDyn(&[2, 5, 3]), |i| {
            (i[0] * 15 + i[1] * 3 + i[2]) as f64 - 7.0
        });
        let c = r.mapv(|v| v * 1.01 + 0.003);
        let d = diagnose(&tensors("dq", r), &tensors("dq", c), &map, 1.0);
        let t = &d.tensors[0];
        let mean_sq = t
            .per_token
            .as_ref()
            .unwrap()
            .iter()
            .map(|e| e * e)
            .sum::<f64>()
            / 10.0;
        assert!(
            (mean_sq.sqrt() - t.norm_ratio).abs() < 1e-12,
            "{} vs {}",
            mean_sq.sqrt(),
            t.norm_ratio
        );
        assert!(t.first_bad.is_none());
    }

    #[test]
    fn the_noise_reference_sets_the_band_chunk_by_chunk() {
        // One sequence of 16 tokens, chunks of 4, V = 4. The candidate has
        // noise 1e-2 in chunk 3 (as a bf16 run at a sequence end) and a fault
        // 0.5 in the upper half of V from chunk 1 on; the noise run has the noise alone.
        let map = TokenMap::new(1, 16, None, &[8], 4);
        let r = ArrayD::from_shape_fn(IxDyn(&[1, 16, 4]), |i| 1.0 + (i[1] + i[2]) as f64);
        let mut noise = r.clone();
        for t in 12..16 {
            noise[[0, t, 0]] *= 1.01;
        }
        let mut faulty = noise.clone();
        for t in 4..16 {
            faulty[[0, t, 3]] += 5.0;
        }
        let nr = tensors("o", noise.clone());
        let with = |c: &ArrayD<f64>| {
            diagnose_with_noise(
                &tensors("o", r.clone()),
                &tensors("o", c.clone()),
                Some(NoiseReference {
                    name: "n".into(),
                    tensors: &nr,
                }),
                &map,
                1e-4,
                Some(4),
            )
        };
        // Noise alone: the fixed band flags chunk 3, the noise band does not.
        let fixed = diagnose(&tensors("o", r.clone()), &nr, &map, 1e-4);
        assert_eq!(fixed.first_bad.as_ref().map(|f| f.1.token), Some(12));
        assert!(with(&noise).first_bad.is_none());
        // The fault starts at chunk 1 (token 4, rank 0); upper V column only.
        let d = with(&faulty);
        assert_eq!(
            d.first_bad.as_ref().map(|f| (f.1.token, f.1.chunk)),
            Some((4, 1))
        );
        // The band drawn is the one used: 4× the noise in chunk 3, the floor elsewhere.
        let band = d.tensors[0].band_per_token(&map).unwrap();
        let noise_chunk3 =
            diagnose(&tensors("o", r.clone()), &nr, &map, 0.0).tensors[0].per_chunk[3].2;
        assert_eq!(band[12], 1e-4f64.max(NOISE_FACTOR * noise_chunk3));
        assert!(band[12] > 1e-4 && band[0] == 1e-4, "{band:?}");
        let cols = &d.tensors[0].per_v_column;
        assert_eq!(cols.len(), 4);
        assert!(cols[3] > 100.0 * cols[1] && cols[1] == 0.0, "{cols:?}");
        assert!(v_columns(&d.tensors[0]).contains("upper half of V only"));
        assert_eq!(d.noise_reference.as_deref(), Some("n"));
    }

    /// Two separate bad stretches in two sequences are two excursions,
    /// each with its sequence, rank and extent; one bad stretch spanning
    /// two chunks is one.
    #[test]
    fn every_excursion_is_listed_with_its_sequence() {
        // Sequences [0,10) and [10,24), ranks cut at 12, chunk 4.
        let map = TokenMap::new(1, 24, Some(&[0, 10, 24]), &[12], 4);
        let r = ArrayD::from_shape_fn(IxDyn(&[1, 24, 2]), |i| 1.0 + i[1] as f64);
        let mut c = r.clone();
        for t in [1, 2, 5, 17, 18, 19, 20] {
            c[[0, t, 0]] += 3.0;
        }
        let d = diagnose(&tensors("o", r), &tensors("o", c), &map, 1e-3);
        let x = &d.tensors[0].excursions;
        assert_eq!(x.len(), 2, "{x:?}");
        // Sequence 0: chunks [0,4) and [4,8) both bad, from token 1.
        assert_eq!((x[0].start.token, x[0].end, x[0].chunks), (1, 8, 2));
        assert_eq!((x[0].start.sequence, x[0].start.rank), (0, 0));
        // Sequence 1: chunks [14,18) and [18,22), from token 17 (rank 1).
        assert_eq!((x[1].start.token, x[1].end, x[1].chunks), (17, 22, 2));
        assert_eq!((x[1].start.sequence, x[1].start.rank), (1, 1));
        let text = d.to_string();
        assert!(text.contains("`o` leaves the band in 2 place(s)"), "{text}");
        assert!(
            text.contains("sequence 1 (batch 0): tokens 17..22 (rank 1"),
            "{text}"
        );
    }
}
