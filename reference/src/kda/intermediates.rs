//! KDA's forward intermediates under FLA's names and layouts (fla-core
//! 0.6.0, `chunk_kda_fwd` with `disable_recompute=True`), so a port can
//! check each sub-function (the table is in README's "Intermediates").
//! Under CP the per-token and per-chunk tensors are every rank's local
//! tensors laid end to end along T: chunks restart at rank cuts as well as
//! sequence starts.

use ndarray::{s, Array2, ArrayD, ArrayView2, IxDyn};

use super::{chunk::Chunk, Kda, KdaInputs, KdaOptions, Prepared};
use crate::cp::{self, RankDiag};
use crate::error::Result;
use crate::fast::par::par_pairs;
use crate::op::{self, OpSpec as _, Operator as _};
use crate::registry::{ChunkPos, Compute, EngineKind, Job, Tensors};
use crate::scalar::Scalar;
use crate::tensor::cast;
use crate::varlen::Segment;
use crate::Error;

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

/// The intermediates of a KDA problem `x` (options `opt`, upstream
/// gradients `up` for CP's merged `dht`) computed as `job` says: the
/// chunked engine, with or without CP, in its scalar, a policy's storage
/// rounding applied. Returns the tensors (widened to f64) and the chunk
/// layout.
pub(crate) fn compute(
    job: &Job<'_>,
    x: &KdaInputs<f64>,
    opt: &KdaOptions,
    up: (&ArrayD<f64>, Option<&ArrayD<f64>>),
) -> Result<(Tensors, Vec<ChunkPos>)> {
    let EngineKind::Chunk(c) = job.engine else {
        return Err(Error::option(
            "impl",
            "intermediates come from the chunked form: use --impl chunk or cp (with --cp-engine chunk)",
        ));
    };
    match job.compute {
        Compute::F64 => compute_in::<f64>(job, c.get(), x, opt, up),
        Compute::F32 => compute_in::<f32>(job, c.get(), x, opt, up),
    }
}

fn compute_in<T: Scalar>(
    job: &Job<'_>,
    c: usize,
    x: &KdaInputs<f64>,
    opt: &KdaOptions,
    (d_o, dht): (&ArrayD<f64>, Option<&ArrayD<f64>>),
) -> Result<(Tensors, Vec<ChunkPos>)> {
    let xt: KdaInputs<T> = x.cast();
    let p = Prepared::new(&xt, opt)?.with_stored_activations(job.policy);
    let engine = Chunk::new(c)?.with_policy(job.policy.clone());
    let (pieces, diags) = match job.cp {
        None => (
            p.segments.iter().map(|&s| (0, s)).collect::<Vec<_>>(),
            vec![],
        ),
        Some((spec, cpo)) => {
            let plan = spec.build(p.dims.b, p.dims.t, x.cu_seqlens.as_deref())?;
            let all = Kda::all_outputs(opt);
            let (_, _, diags) = cp::forward_backward(
                &engine,
                &xt,
                &all,
                &cast(d_o),
                dht.map(cast::<f64, T>).as_ref(),
                spec,
                cpo,
            )?;
            let pieces = plan
                .ranks
                .iter()
                .flat_map(|r| r.pieces.iter().map(move |&s| (r.rank, s)))
                .collect();
            (pieces, diags)
        }
    };
    Ok((
        fill(&p, &engine, &pieces, &diags, c),
        chunk_positions(&pieces, c),
    ))
}

/// The initial state a CP piece runs from (merged, its sequence's own, or zeros).
fn piece_h0<T: Scalar>(
    p: &Prepared<T>,
    pieces: &[(usize, Segment)],
    diags: &[RankDiag<T>],
    i: usize,
    h: usize,
) -> Array2<T> {
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
        _ => Array2::zeros((p.dims.k, p.dims.v)),
    }
}

fn fill<T: Scalar>(
    p: &Prepared<T>,
    engine: &Chunk,
    pieces: &[(usize, Segment)],
    diags: &[RankDiag<T>],
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
        engine.forward_intermediates(&Kda::head(p, &pieces[i].1, h), h0.view())
    });
    let log2e = std::f64::consts::LOG2_E;
    let scale = p.scale.f64();
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
            let put = |out: &mut Tensors, name: &str, sl, val: ArrayView2<T>| {
                out.get_mut(name)
                    .expect("allocated")
                    .slice_mut(sl)
                    .assign(&val.mapv(|x| x.f64()));
            };
            put(
                &mut out,
                "g_cumsum",
                rows,
                ch.g_cumsum.mapv(|g| T::c(g.f64() * log2e)).view(),
            );
            put(&mut out, "Aqk", cols, ch.aqk.view());
            put(&mut out, "Akk", cols, ch.n_inv.view());
            put(&mut out, "w", rows, ch.w.view());
            put(&mut out, "u", rows, ch.u.view());
            put(
                &mut out,
                "qg",
                rows,
                ch.qg.mapv(|q| T::c(q.f64() / scale)).view(),
            );
            put(&mut out, "kg", rows, ch.kg.view());
            let vn = f.v_new.slice(s![ch.start..ch.start + ch.len(), ..]);
            put(&mut out, "v_new", rows, vn);
            let idx = chunks[first + n].index;
            out.get_mut("h")
                .expect("allocated")
                .slice_mut(s![seg.batch, idx, h, .., ..])
                .assign(&f.h.index_axis(ndarray::Axis(0), n).mapv(|x| x.f64()));
        }
    }
    if !diags.is_empty() {
        let per_rank =
            |f: fn(&RankDiag<T>) -> Option<&[Array2<T>]>| diags.iter().map(f).collect::<Vec<_>>();
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
fn stack<T: Scalar>(per_rank: &[Option<&[Array2<T>]>], [hv, k, cols]: [usize; 3]) -> ArrayD<f64> {
    let mut a = ArrayD::zeros(IxDyn(&[per_rank.len(), hv, k, cols]));
    for (r, m) in per_rank.iter().enumerate() {
        for (h, m) in m.iter().flat_map(|m| m.iter()).enumerate() {
            a.slice_mut(s![r, h, .., ..]).assign(&m.mapv(|x| x.f64()));
        }
    }
    a
}
