//! Token-shift on the GPU (SPEC §5), plain or under simulated CP: a rank's
//! continuing first piece reads the previous rank's last token as its cache,
//! and in backward hands that token its gradient.

use cudarc::driver::PushKernelArg;
use deltaref::token_shift::{TokenShiftGrads, TokenShiftOutputs, TokenShiftRefs};
use deltaref::varlen::Segment;
use ndarray::{s, ArrayD, Axis};

use crate::device::{arg_in, arg_in_opt, arg_opt, elementwise, Gpu};
use crate::error::Result;
use crate::kernels::{check_sizes, prep_defines, TOKEN_SHIFT};
use crate::{GpuImpl, Run, Timings};

/// One piece: `{start, end, seq, link}` for the kernels plus where its
/// results go.
struct Piece {
    row: [i32; 4],
    seq: usize,
    /// Ends its sequence: its last token is the sequence's final cache.
    ends: bool,
    /// The flattened token that receives the piece's `d(prev)` (CP), else
    /// `d(prev)` is the sequence's `dcache`.
    send_back: Option<usize>,
}

/// The pieces of the validated sequences `segs` of a `[B, T]` batch, whole
/// or split over ranks by `imp.cp`.
fn piece_table(
    segs: &[Segment],
    cu_seqlens: Option<&[i64]>,
    imp: &GpuImpl,
    b: usize,
    t: usize,
) -> Result<Vec<Piece>> {
    let whole = |seq: usize, start: usize, end: usize, base: usize| Piece {
        row: [(base + start) as i32, (base + end) as i32, seq as i32, -1],
        seq,
        ends: true,
        send_back: None,
    };
    let Some(spec) = &imp.cp else {
        return Ok(segs
            .iter()
            .map(|s| whole(s.seq, s.start, s.end, s.batch * t))
            .collect());
    };
    let plan = spec.build(b, t, cu_seqlens)?;
    let mut out = vec![];
    for rm in &plan.ranks {
        for (i, seg) in rm.pieces.iter().enumerate() {
            let link = (i == 0 && rm.continues()).then(|| rm.start - 1);
            let mut p = whole(seg.seq, seg.start, seg.end, 0);
            p.row[3] = link.map_or(-1, |l| l as i32);
            p.ends = seg.end == plan.cu_seqlens[seg.seq + 1] as usize;
            p.send_back = link;
            out.push(p);
        }
    }
    Ok(out)
}

/// Token-shift forward and backward on the GPU, from inputs borrowed where
/// they live (a case's tensors, uncopied).
pub fn run(
    gpu: &Gpu,
    x: &TokenShiftRefs<'_, f64>,
    dy: &ArrayD<f64>,
    dfinal_cache: Option<&ArrayD<f64>>,
    imp: &GpuImpl,
) -> Result<Run<TokenShiftOutputs<f64>, TokenShiftGrads<f64>>> {
    let t = std::time::Instant::now();
    let (d, segs) = x.validate()?;
    d.validate_upstream(dy, dfinal_cache)?;
    let check_s = t.elapsed().as_secs_f64();
    check_sizes(1, 1, d.b * d.t)?;
    let table = piece_table(&segs, x.cu_seqlens, imp, d.b, d.t)?;
    let defs = prep_defines(imp.storage);
    let ntok = d.b * d.t;
    let xs = gpu.upload_input("x", x.x, imp.storage)?;
    let cache = x
        .cache
        .map(|c| gpu.upload_input("cache", c, imp.storage))
        .transpose()?;
    let dys = gpu.upload_input("dy", dy, imp.storage)?;
    let dfc = dfinal_cache
        .map(|c| gpu.upload_f32("dfinal_cache", c))
        .transpose()?;
    let (np, dd) = (table.len(), d.d as i32);
    let fwd_rows: Vec<i32> = table.iter().flat_map(|p| p.row).collect();
    let bwd_rows: Vec<i32> = table
        .iter()
        .flat_map(|p| [p.row[0], p.row[1], p.row[2], i32::from(p.ends)])
        .collect();
    let to: Vec<i32> = table
        .iter()
        .map(|p| p.send_back.map_or(-1, |t| t as i32))
        .collect();
    let (fwd_seg, bwd_seg, to_dev) = (
        gpu.upload("pieces", &fwd_rows)?,
        gpu.upload("pieces", &bwd_rows)?,
        gpu.upload("send-back targets", &to)?,
    );
    let upload_s = t.elapsed().as_secs_f64();
    let mut y = gpu.zeros::<f32>("y", ntok * d.d)?;
    let mut last = gpu.zeros::<f32>("last tokens", np * d.d)?;
    let threads = d.d.min(1024);
    let per_piece = crate::device::grid(np, 1, threads, 0);
    let ((), forward_s) = gpu.timed("token-shift forward", || {
        if np == 0 {
            return Ok(());
        }
        let f = gpu.function(&TOKEN_SHIFT, defs, "ts_fwd")?;
        let mut b = gpu.stream().launch_builder(&f);
        arg_in(&mut b, &xs);
        arg_in_opt(&mut b, cache.as_ref());
        b.arg(&mut y).arg(&mut last).arg(&fwd_seg).arg(&dd);
        gpu.launch(b, "ts_fwd", per_piece)
    })?;
    let mut dx = gpu.zeros::<f32>("dx", ntok * d.d)?;
    let mut dprev = gpu.zeros::<f32>("d(prev)", np * d.d)?;
    let ((), backward_s) = gpu.timed("token-shift backward", || {
        if np == 0 {
            return Ok(());
        }
        let f = gpu.function(&TOKEN_SHIFT, defs, "ts_bwd")?;
        let mut b = gpu.stream().launch_builder(&f);
        arg_in(&mut b, &dys);
        arg_opt(&mut b, dfc.as_ref());
        b.arg(&mut dx).arg(&mut dprev).arg(&bwd_seg).arg(&dd);
        gpu.launch(b, "ts_bwd", per_piece)?;
        let f = gpu.function(&TOKEN_SHIFT, defs, "ts_send_back")?;
        let s = np as i32;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&mut dx).arg(&dprev).arg(&to_dev).arg(&s).arg(&dd);
        gpu.launch(b, "ts_send_back", elementwise(np * d.d))
    })?;
    let t = std::time::Instant::now();
    let token = Some(imp.storage);
    let last = gpu.fetch("final cache", last, &[np, d.d], None)?;
    let dprev = gpu.fetch("dcache", dprev, &[np, d.d], None)?;
    // Sequences without tokens pass cache → final_cache and dfinal_cache → dcache.
    let mut final_cache = x
        .cache
        .cloned()
        .unwrap_or_else(|| ArrayD::zeros(vec![d.n, d.d]));
    let mut dcache = dfinal_cache
        .cloned()
        .unwrap_or_else(|| ArrayD::zeros(vec![d.n, d.d]));
    for (i, p) in table.iter().enumerate() {
        if p.ends {
            final_cache
                .slice_mut(s![p.seq, ..])
                .assign(&last.index_axis(Axis(0), i));
        }
        if p.send_back.is_none() {
            dcache
                .slice_mut(s![p.seq, ..])
                .assign(&dprev.index_axis(Axis(0), i));
        }
    }
    let outputs = TokenShiftOutputs {
        y: gpu.fetch("y", y, x.x.shape(), token)?,
        final_cache,
    };
    let grads = TokenShiftGrads {
        dx: gpu.fetch("dx", dx, x.x.shape(), token)?,
        dcache: x.cache.map(|_| dcache),
    };
    Ok(Run {
        outputs,
        grads,
        timings: Timings {
            forward_s,
            backward_s,
            upload_s,
            check_s,
            download_s: t.elapsed().as_secs_f64(),
            ..Timings::default()
        },
    })
}
