//! The chunked KDA kernels (`kda_chunk.cu`, FLA's `chunk_kda` structure) as a
//! `Recurrence` (`crate::cp`): intra-chunk stage, state pass, output;
//! backward recomputes the forward intermediates, runs the dh pass, then each
//! chunk's backward.

use cudarc::driver::{CudaSlice, PushKernelArg};
use deltaref::varlen::Segment;

use super::{Grads, Problem};
use crate::cp::Recurrence;
use crate::device::{arg_opt, grid, Gpu};
use crate::error::Result;
use crate::kernels::{Defines, KDA_CHUNK};
use crate::pieces::Chunks;

/// Threads of the per-chunk kernels.
const CHUNK_THREADS: usize = 256;

pub(crate) struct Chunked<'a, 'g> {
    p: &'a Problem<'g>,
    size: usize,
}

/// The intra-chunk intermediates of a chunk list, `[chunks, HV, …]` padded.
struct Intra {
    chunks: Chunks,
    chunk: CudaSlice<i32>,
    segc: CudaSlice<i32>,
    g: CudaSlice<f32>,
    aqk: CudaSlice<f32>,
    p: CudaSlice<f32>,
    ninv: CudaSlice<f32>,
    akk: CudaSlice<f32>,
    w: CudaSlice<f32>,
    u: CudaSlice<f32>,
    qg: CudaSlice<f32>,
    kg: CudaSlice<f32>,
}

/// The state pass's outputs: `h` entering each chunk, `v_new`.
struct StatePass {
    h: CudaSlice<f32>,
    vn: CudaSlice<f32>,
    ht: CudaSlice<f32>,
}

impl<'a, 'g> Chunked<'a, 'g> {
    pub fn new(p: &'a Problem<'g>, size: usize) -> Result<Self> {
        deltaref::registry::ChunkSize::new(size)?;
        Ok(Chunked { p, size })
    }

    fn defines(&self) -> Defines {
        Defines {
            in_bf16: false,
            kd: self.p.d.k,
            chunk: self.size,
        }
    }

    fn gpu_(&self) -> &'g Gpu {
        self.p.gpu
    }

    fn intra(&self, pieces: &[Segment]) -> Result<Intra> {
        let (gpu, d, c) = (self.gpu_(), self.p.d, self.size);
        let chunks = Chunks::new(pieces, d.t, c);
        let pairs = chunks.count() * d.hv;
        let z = |what: &str, per: usize| gpu.zeros::<f32>(what, pairs * per);
        let mut it = Intra {
            chunk: gpu.upload("chunk list", &chunks.chunk)?,
            segc: gpu.upload("piece chunk ranges", &chunks.segc)?,
            g: z("Γ", c * d.k)?,
            aqk: z("Aqk", c * c)?,
            p: z("KKᵀ decay products", c * c)?,
            ninv: z("(I + L)^-1", c * c)?,
            akk: z("Akk", c * c)?,
            w: z("w", c * d.k)?,
            u: z("u", c * d.v)?,
            qg: z("qg", c * d.k)?,
            kg: z("kg", c * d.k)?,
            chunks,
        };
        if pairs == 0 {
            return Ok(it);
        }
        let f = gpu.function(&KDA_CHUNK, self.defines(), "kda_chunk_intra")?;
        let (h, hv, v) = (d.h as i32, d.hv as i32, d.v as i32);
        let pr = self.p;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&pr.q)
            .arg(&pr.k)
            .arg(&pr.v)
            .arg(&pr.g)
            .arg(&pr.beta)
            .arg(&it.chunk)
            .arg(&h)
            .arg(&hv)
            .arg(&v)
            .arg(&mut it.g)
            .arg(&mut it.aqk)
            .arg(&mut it.p)
            .arg(&mut it.ninv)
            .arg(&mut it.akk)
            .arg(&mut it.w)
            .arg(&mut it.u)
            .arg(&mut it.qg)
            .arg(&mut it.kg);
        gpu.launch(
            b,
            "kda_chunk_intra",
            grid(it.chunks.count(), d.hv, CHUNK_THREADS, 0),
        )?;
        Ok(it)
    }

    /// The state pass over `pieces` from `h0`; with `transition`, M instead.
    fn state_pass(
        &self,
        it: &Intra,
        pieces: usize,
        h0: Option<&CudaSlice<f32>>,
        transition: bool,
    ) -> Result<StatePass> {
        let (gpu, d, c) = (self.gpu_(), self.p.d, self.size);
        let ncol = if transition { d.k } else { d.v };
        let pairs = it.chunks.count() * d.hv;
        let keep = !transition;
        let mut sp = StatePass {
            h: gpu.zeros::<f32>("h", if keep { pairs * d.k * d.v } else { 0 })?,
            vn: gpu.zeros::<f32>("v_new", if keep { pairs * c * d.v } else { 0 })?,
            ht: gpu.zeros::<f32>("final states", pieces * d.hv * d.k * ncol)?,
        };
        if pieces == 0 {
            return Ok(sp);
        }
        let f = gpu.function(&KDA_CHUNK, self.defines(), "kda_chunk_fwd_h")?;
        let (hv, nc, tr) = (d.hv as i32, ncol as i32, i32::from(transition));
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&it.segc).arg(&it.g).arg(&it.w).arg(&it.u).arg(&it.kg);
        arg_opt(&mut b, if transition { None } else { h0 });
        arg_opt(&mut b, keep.then_some(&sp.h));
        arg_opt(&mut b, keep.then_some(&sp.vn));
        b.arg(&mut sp.ht).arg(&hv).arg(&nc).arg(&tr);
        gpu.launch(b, "kda_chunk_fwd_h", grid(pieces, d.hv, ncol, 0))?;
        Ok(sp)
    }
}

impl Recurrence for Chunked<'_, '_> {
    type Grads = Grads;

    fn gpu(&self) -> &Gpu {
        self.p.gpu
    }

    fn shape(&self) -> (usize, usize, usize) {
        (self.p.d.hv, self.p.d.k, self.p.d.v)
    }

    fn forward(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        o: Option<&mut CudaSlice<f32>>,
    ) -> Result<CudaSlice<f32>> {
        let it = self.intra(pieces)?;
        let sp = self.state_pass(&it, pieces.len(), h0, false)?;
        if let (Some(o), true) = (o, it.chunks.count() > 0) {
            let (gpu, d) = (self.gpu_(), self.p.d);
            let f = gpu.function(&KDA_CHUNK, self.defines(), "kda_chunk_fwd_o")?;
            let (hv, v) = (d.hv as i32, d.v as i32);
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(&it.chunk)
                .arg(&it.qg)
                .arg(&it.aqk)
                .arg(&sp.h)
                .arg(&sp.vn)
                .arg(o)
                .arg(&hv)
                .arg(&v);
            gpu.launch(
                b,
                "kda_chunk_fwd_o",
                grid(it.chunks.count(), d.hv, CHUNK_THREADS, 0),
            )?;
        }
        Ok(sp.ht)
    }

    fn transition(&self, pieces: &[Segment]) -> Result<CudaSlice<f32>> {
        let it = self.intra(pieces)?;
        Ok(self.state_pass(&it, pieces.len(), None, true)?.ht)
    }

    fn backward(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        dht: Option<&CudaSlice<f32>>,
        g: &mut Grads,
    ) -> Result<CudaSlice<f32>> {
        let (gpu, d, c, pr) = (self.gpu_(), self.p.d, self.size, self.p);
        let it = self.intra(pieces)?;
        let sp = self.state_pass(&it, pieces.len(), h0, false)?;
        let pairs = it.chunks.count() * d.hv;
        let mut dh = gpu.zeros::<f32>("dh", pairs * d.k * d.v)?;
        let mut dvn = gpu.zeros::<f32>("dv_new", pairs * c * d.v)?;
        let mut dh0 = gpu.zeros::<f32>("dh0", pieces.len() * d.hv * d.k * d.v)?;
        if pieces.is_empty() {
            return Ok(dh0);
        }
        let (hv, v, h) = (d.hv as i32, d.v as i32, d.h as i32);
        let f = gpu.function(&KDA_CHUNK, self.defines(), "kda_chunk_bwd_dh")?;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&it.segc)
            .arg(&it.chunk)
            .arg(&it.g)
            .arg(&it.aqk)
            .arg(&it.w)
            .arg(&it.qg)
            .arg(&it.kg)
            .arg(&pr.d_o);
        arg_opt(&mut b, dht);
        b.arg(&mut dh).arg(&mut dvn).arg(&mut dh0).arg(&hv).arg(&v);
        gpu.launch(b, "kda_chunk_bwd_dh", grid(pieces.len(), d.hv, d.v, 0))?;
        if pairs == 0 {
            return Ok(dh0);
        }
        // BWD_SCRATCH and BWD_DSCRATCH of kda_chunk.cu.
        let per_pair = 6 * c * d.k + 4 * c * c + c;
        let mut scratch = gpu.zeros::<f32>("chunk backward scratch", pairs * per_pair)?;
        let mut dscratch =
            gpu.zeros::<f64>("chunk backward dΓ scratch", pairs * (c * d.k + 2 * d.k))?;
        let f = gpu.function(&KDA_CHUNK, self.defines(), "kda_chunk_bwd_intra")?;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&pr.q)
            .arg(&pr.k)
            .arg(&pr.v)
            .arg(&pr.beta)
            .arg(&pr.d_o)
            .arg(&it.chunk)
            .arg(&it.g)
            .arg(&it.aqk)
            .arg(&it.p)
            .arg(&it.ninv)
            .arg(&it.akk)
            .arg(&it.qg)
            .arg(&it.kg)
            .arg(&sp.h)
            .arg(&dh)
            .arg(&sp.vn)
            .arg(&dvn)
            .arg(&mut scratch)
            .arg(&mut dscratch)
            .arg(&mut g.dq)
            .arg(&mut g.dk)
            .arg(&mut g.dv)
            .arg(&mut g.dg)
            .arg(&mut g.dbeta)
            .arg(&h)
            .arg(&hv)
            .arg(&v);
        gpu.launch(
            b,
            "kda_chunk_bwd_intra",
            grid(it.chunks.count(), d.hv, CHUNK_THREADS, 0),
        )?;
        Ok(dh0)
    }

    fn scratch_grads(&self) -> Result<Grads> {
        Grads::zeros(self.p)
    }
}
