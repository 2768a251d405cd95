//! DPLR on the GPU (SPEC §4): the naive recurrent kernels (`dplr_naive.cu`),
//! plain or under simulated CP. `q` is scaled on the way in and `dq` on the
//! way out; everything else is read as stored.

use cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};
use deltaref::dplr::{DplrDims, DplrGrads, DplrOptions, DplrOutputs, DplrRefs};
use deltaref::varlen::Segment;
use ndarray::ArrayD;

use crate::cp::{self, Recurrence};
use deltaref::Dtype;

use crate::device::{arg_in, arg_opt, elementwise, grid, mapped_zeros, Gpu, Input};
use crate::error::{GpuError, Result};
use crate::kernels::{check_sizes, prep_defines, Defines, DPLR_NAIVE, PREP};
use crate::pieces::upload_ranges;
use crate::recurrent::BackwardScratch;
use crate::{Engine, GpuImpl, Run, Timings};

/// A validated DPLR problem on the device (f32 working copies).
struct Problem<'g> {
    gpu: &'g Gpu,
    d: DplrDims,
    storage: Dtype,
    scale: f32,
    raw_q: Input,
    h0: Option<CudaSlice<f32>>,
    dht: Option<CudaSlice<f32>>,
    /// `[NTOK, H, K]`, `q` times scale.
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    a: CudaSlice<f32>,
    b: CudaSlice<f32>,
    gk: CudaSlice<f32>,
    /// `[NTOK, H, V]`
    v: CudaSlice<f32>,
    d_o: CudaSlice<f32>,
}

/// Token gradients, `[NTOK, H, K]` (`dv`: `[NTOK, H, V]`).
struct Grads {
    dq: CudaSlice<f32>,
    dk: CudaSlice<f32>,
    dv: CudaSlice<f32>,
    da: CudaSlice<f32>,
    db: CudaSlice<f32>,
    dgk: CudaSlice<f32>,
}

impl<'g> Problem<'g> {
    /// Uploads and pre-processes a problem the caller validated (`d` its
    /// sizes).
    fn new(
        gpu: &'g Gpu,
        d: DplrDims,
        x: &DplrRefs<'_, f64>,
        opts: &DplrOptions,
        d_o: &ArrayD<f64>,
        dht: Option<&ArrayD<f64>>,
        storage: Dtype,
    ) -> Result<Problem<'g>> {
        check_sizes(d.k, d.v, d.b * d.t)?;
        let scale = opts.scale.unwrap_or(1.0 / (d.k as f64).sqrt()) as f32;
        let ntok = d.b * d.t;
        let defs = prep_defines(storage);
        let raw_q = gpu.upload_input("q", x.q, storage)?;
        let mut q = gpu.zeros::<f32>("q", ntok * d.h * d.k)?;
        let f = gpu.function(&PREP, defs, "prep_rows")?;
        let (rows, kd, no_l2) = ((ntok * d.h) as i64, d.k as i32, 0i32);
        let mut b = gpu.stream().launch_builder(&f);
        arg_in(&mut b, &raw_q);
        b.arg(&mut q).arg(&rows).arg(&kd).arg(&no_l2).arg(&scale);
        gpu.launch(b, "prep_rows", elementwise(ntok * d.h))?;
        let convert = |what: &str, a: &ArrayD<f64>| -> Result<CudaSlice<f32>> {
            let raw = gpu.upload_input(what, a, storage)?;
            let mut out = gpu.zeros::<f32>(what, a.len())?;
            let f = gpu.function(&PREP, defs, "to_f32")?;
            let n = a.len() as i64;
            let mut b = gpu.stream().launch_builder(&f);
            arg_in(&mut b, &raw);
            b.arg(&mut out).arg(&n);
            gpu.launch(b, "to_f32", elementwise(a.len()))?;
            Ok(out)
        };
        let up32 =
            |what: &str, a: Option<&ArrayD<f64>>| a.map(|a| gpu.upload_f32(what, a)).transpose();
        Ok(Problem {
            gpu,
            d,
            storage,
            scale,
            k: convert("k", x.k)?,
            a: convert("a", x.a)?,
            b: convert("b", x.b)?,
            gk: convert("gk", x.gk)?,
            v: convert("v", x.v)?,
            d_o: convert("do", d_o)?,
            h0: up32("initial_state", x.initial_state)?,
            dht: up32("dht", dht)?,
            raw_q,
            q,
        })
    }

    fn tokens(&self) -> usize {
        self.d.b * self.d.t
    }

    fn defines(&self) -> Defines {
        Defines {
            in_bf16: false,
            kd: self.d.k,
            chunk: 0,
        }
    }

    /// Pushes the f32 inputs and the piece ranges.
    fn push_inputs<'a>(&'a self, b: &mut LaunchArgs<'a>, seg: &'a CudaSlice<i32>) {
        b.arg(&self.q)
            .arg(&self.k)
            .arg(&self.v)
            .arg(&self.a)
            .arg(&self.b)
            .arg(&self.gk)
            .arg(seg);
    }

    fn run_fwd(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        o: Option<&mut CudaSlice<f32>>,
        transition: bool,
    ) -> Result<CudaSlice<f32>> {
        let (gpu, d) = (self.gpu, self.d);
        let ncol = if transition { d.k } else { d.v };
        let mut ht = gpu.zeros::<f32>("final states", pieces.len() * d.h * d.k * ncol)?;
        if pieces.is_empty() {
            return Ok(ht);
        }
        let seg = upload_ranges(gpu, pieces, d.t)?;
        let f = gpu.function(&DPLR_NAIVE, self.defines(), "dplr_naive_fwd")?;
        let (h, nc, tr) = (d.h as i32, ncol as i32, i32::from(transition));
        let mut b = gpu.stream().launch_builder(&f);
        self.push_inputs(&mut b, &seg);
        arg_opt(&mut b, h0);
        arg_opt(&mut b, o.map(|o| &*o));
        b.arg(&mut ht).arg(&h).arg(&nc).arg(&tr);
        gpu.launch(b, "dplr_naive_fwd", grid(pieces.len(), d.h, ncol, 0))?;
        Ok(ht)
    }
}

impl Recurrence for Problem<'_> {
    type Grads = Grads;

    fn gpu(&self) -> &Gpu {
        self.gpu
    }

    fn shape(&self) -> (usize, usize, usize) {
        (self.d.h, self.d.k, self.d.v)
    }

    fn forward(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        o: Option<&mut CudaSlice<f32>>,
    ) -> Result<CudaSlice<f32>> {
        self.run_fwd(pieces, h0, o, false)
    }

    fn transition(&self, pieces: &[Segment]) -> Result<CudaSlice<f32>> {
        self.run_fwd(pieces, None, None, true)
    }

    fn backward(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        dht: Option<&CudaSlice<f32>>,
        g: &mut Grads,
    ) -> Result<CudaSlice<f32>> {
        let (gpu, d) = (self.gpu, self.d);
        let kv = d.k * d.v;
        let mut dh0 = gpu.zeros::<f32>("dh0", pieces.len() * d.h * kv)?;
        if pieces.is_empty() {
            return Ok(dh0);
        }
        let mut sc = BackwardScratch::new(gpu, "DPLR", pieces, d.h, (d.k, d.v), (5, 0))?;
        let seg = upload_ranges(gpu, pieces, d.t)?;
        let f = gpu.function(&DPLR_NAIVE, self.defines(), "dplr_naive_bwd")?;
        let (h, v) = (d.h as i32, d.v as i32);
        let mut b = gpu.stream().launch_builder(&f);
        self.push_inputs(&mut b, &seg);
        arg_opt(&mut b, h0);
        b.arg(&self.d_o);
        arg_opt(&mut b, dht);
        b.arg(&mut g.dq)
            .arg(&mut g.dk)
            .arg(&mut g.dv)
            .arg(&mut g.da)
            .arg(&mut g.db)
            .arg(&mut g.dgk)
            .arg(&mut dh0)
            .arg(&h)
            .arg(&v);
        let shared = sc.shared;
        sc.push(&mut b);
        gpu.launch(b, "dplr_naive_bwd", grid(pieces.len(), d.h, d.v, shared))?;
        Ok(dh0)
    }

    fn scratch_grads(&self) -> Result<Grads> {
        let (ntok, d) = (self.tokens(), self.d);
        let z = |what: &str, n: usize| self.gpu.zeros::<f32>(what, n);
        Ok(Grads {
            dq: z("dq", ntok * d.h * d.k)?,
            dk: z("dk", ntok * d.h * d.k)?,
            dv: z("dv", ntok * d.h * d.v)?,
            da: z("da", ntok * d.h * d.k)?,
            db: z("db", ntok * d.h * d.k)?,
            dgk: z("dgk", ntok * d.h * d.k)?,
        })
    }
}

/// DPLR forward and backward on the GPU (naive engine; CP when `imp.cp` is
/// set) from inputs borrowed where they live (`DplrInputs::refs`, or a
/// case's tensors, uncopied): `o`, `final_state` and every gradient (shaped
/// like the oracle's), with kernel and host timings.
pub fn run(
    gpu: &Gpu,
    x: &DplrRefs<'_, f64>,
    opts: &DplrOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    imp: &GpuImpl,
) -> Result<Run<DplrOutputs<f64>, DplrGrads<f64>>> {
    if imp.engine != Engine::Naive {
        return Err(GpuError::Unsupported(
            "DPLR has only the naive GPU kernels (use gpu-naive, or gpu-cp with the naive engine)"
                .into(),
        ));
    }
    let compiled = gpu.compile_seconds();
    let t = std::time::Instant::now();
    let d = x.validate(opts)?;
    d.validate_upstream(d_o, dht)?;
    let check_s = t.elapsed().as_secs_f64();
    let p = Problem::new(gpu, d, x, opts, d_o, dht, imp.storage)?;
    gpu.sync("DPLR inputs")?;
    let upload_s = t.elapsed().as_secs_f64();
    let mut run = run_problem(&p, x, imp)?;
    run.timings.upload_s = upload_s;
    run.timings.check_s = check_s;
    run.timings.compile_s = gpu.compile_seconds() - compiled;
    Ok(run)
}

/// The kernels of an uploaded problem, and its results fetched into host
/// memory mapped meanwhile on the other cores.
fn run_problem(
    p: &Problem,
    x: &DplrRefs<'_, f64>,
    imp: &GpuImpl,
) -> Result<Run<DplrOutputs<f64>, DplrGrads<f64>>> {
    let (gpu, d) = (p.gpu, p.d);
    let mut o = gpu.zeros::<f32>("o", p.tokens() * d.h * d.v)?;
    std::thread::scope(|s| {
        // The results' host memory, mapped on the other cores meanwhile
        // (see `mapped_zeros`).
        let lens = [x.v, x.q, x.k, x.v, x.a, x.b, x.gk].map(|t| t.len());
        let landing = s.spawn(move || lens.map(mapped_zeros));
        let (batch, io) = ((d.b, d.t, x.cu_seqlens), (p.h0.as_ref(), p.dht.as_ref()));
        let ph = cp::forward_backward(p, "DPLR", batch, imp.cp.as_ref(), io, &mut o)?;
        let t = std::time::Instant::now();
        let [o_host, dq_host, dk_host, dv_host, da_host, db_host, dgk_host] =
            landing.join().expect("mapping the results' memory");
        let g = ph.grads;
        let dq = p.chain_dq(&g.dq)?;
        let token = |what: &str, t: CudaSlice<f32>, like: &ArrayD<f64>, out: Vec<f64>| {
            gpu.fetch_into(what, t, like.shape(), Some(p.storage), out)
        };
        let state = [d.n, d.h, d.k, d.v];
        let outputs = DplrOutputs {
            o: token("o", o, x.v, o_host)?,
            final_state: Some(gpu.fetch("final_state", ph.ht, &state, None)?),
        };
        let grads = DplrGrads {
            dq: token("dq", dq, x.q, dq_host)?,
            dk: token("dk", g.dk, x.k, dk_host)?,
            dv: token("dv", g.dv, x.v, dv_host)?,
            da: token("da", g.da, x.a, da_host)?,
            db: token("db", g.db, x.b, db_host)?,
            dgk: token("dgk", g.dgk, x.gk, dgk_host)?,
            dh0: match x.initial_state {
                Some(_) => Some(gpu.fetch("dh0", ph.dh0, &state, None)?),
                None => None,
            },
        };
        gpu.sync("DPLR results")?;
        Ok(Run {
            outputs,
            grads,
            timings: Timings {
                forward_s: ph.forward_s,
                backward_s: ph.backward_s,
                download_s: t.elapsed().as_secs_f64(),
                ..Timings::default()
            },
        })
    })
}

impl Problem<'_> {
    /// `dq` with respect to the unscaled `q`, `[NTOK, H, K]`: a GVA "group"
    /// of one head, no l2norm.
    fn chain_dq(&self, dq_scaled: &CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        let (gpu, d) = (self.gpu, self.d);
        let mut dq = gpu.zeros::<f32>("dq", self.tokens() * d.h * d.k)?;
        let f = gpu.function(&PREP, prep_defines(self.storage), "group_l2norm_bwd")?;
        let (rows, h, one, k, no_l2) = (
            (self.tokens() * d.h) as i64,
            d.h as i32,
            1i32,
            d.k as i32,
            0i32,
        );
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(dq_scaled);
        arg_in(&mut b, &self.raw_q);
        b.arg(&mut dq)
            .arg(&rows)
            .arg(&h)
            .arg(&one)
            .arg(&k)
            .arg(&no_l2)
            .arg(&self.scale);
        gpu.launch(b, "group_l2norm_bwd", elementwise(self.tokens() * d.h))?;
        Ok(dq)
    }
}
