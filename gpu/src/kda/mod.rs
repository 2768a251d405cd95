//! KDA on the GPU (SPEC §3): the pre-processing FLA fuses into its kernels
//! (l2norm, scale, gates, beta sigmoid) runs as kernels, then an engine
//! (`naive` or `chunk`) runs every piece, optionally under simulated CP, then
//! the backward chains through GVA, l2norm, the gates and the beta sigmoid.
//! Validation is the oracle's, so bad input gets the same error on both sides.

pub mod chunk;
pub mod naive;

use cudarc::driver::{CudaSlice, PushKernelArg};
use deltaref::gates::{Gate, L2NORM_EPS};
use deltaref::kda::{KdaDims, KdaGrads, KdaOptions, KdaOutputs, KdaRefs};
use ndarray::ArrayD;

use crate::cp::{self, Recurrence};
use deltaref::Dtype;

use crate::device::{arg_in, arg_opt, elementwise, mapped_zeros, Gpu, Input};
use crate::error::Result;
use crate::kernels::{check_sizes, prep_defines, Defines, PREP};
use crate::{Engine, GpuImpl, Run, Timings};

const _: () = assert!(L2NORM_EPS == 1e-6, "prep.cu hard-codes FLA's l2norm eps");

/// A validated KDA problem on the device, pre-processed.
pub(crate) struct Problem<'g> {
    pub gpu: &'g Gpu,
    pub d: KdaDims,
    pub storage: Dtype,
    opts: KdaOptions,
    scale: f32,
    raw_q: Input,
    raw_k: Input,
    raw_g: Input,
    raw_beta: Input,
    a_log: Option<CudaSlice<f32>>,
    dt_bias: Option<CudaSlice<f32>>,
    pub h0: Option<CudaSlice<f32>>,
    /// `[NTOK, H, K]`, l2-normalised if asked, times scale.
    pub q: CudaSlice<f32>,
    /// `[NTOK, H, K]`, l2-normalised if asked.
    pub k: CudaSlice<f32>,
    /// `[NTOK, HV, V]`
    pub v: CudaSlice<f32>,
    /// `[NTOK, HV, K]` log decay.
    pub g: CudaSlice<f32>,
    /// `[NTOK, HV]`
    pub beta: CudaSlice<f32>,
    /// `[NTOK, HV, V]` (stored like the inputs: FLA's `do` has their dtype)
    pub d_o: CudaSlice<f32>,
    /// `[N, HV, K, V]`
    pub dht: Option<CudaSlice<f32>>,
}

/// Per-value-head token gradients the engines write.
pub(crate) struct Grads {
    /// `[NTOK, HV, K]`
    pub dq: CudaSlice<f32>,
    pub dk: CudaSlice<f32>,
    pub dg: CudaSlice<f32>,
    /// `[NTOK, HV, V]`
    pub dv: CudaSlice<f32>,
    /// `[NTOK, HV]`
    pub dbeta: CudaSlice<f32>,
}

impl Grads {
    pub fn zeros(p: &Problem) -> Result<Grads> {
        let (ntok, d) = (p.tokens(), &p.d);
        let z = |what: &str, n: usize| p.gpu.zeros::<f32>(what, n);
        Ok(Grads {
            dq: z("dq", ntok * d.hv * d.k)?,
            dk: z("dk", ntok * d.hv * d.k)?,
            dg: z("dg", ntok * d.hv * d.k)?,
            dv: z("dv", ntok * d.hv * d.v)?,
            dbeta: z("dbeta", ntok * d.hv)?,
        })
    }
}

fn gate_code(g: Gate) -> (i32, f32) {
    match g {
        Gate::None => (0, 0.0),
        Gate::Kda => (1, 0.0),
        Gate::LowerBound { lower_bound } => (2, lower_bound as f32),
    }
}

fn beta_factor(opts: &KdaOptions) -> f32 {
    if opts.allow_neg_eigval {
        2.0
    } else {
        1.0
    }
}

impl<'g> Problem<'g> {
    /// Uploads and pre-processes a problem the caller validated (`d` its
    /// sizes). With a scalar gate `g [B,T,HV]` (GDN), `opts.gate` may be the
    /// kda gate with per-head `dt_bias [HV]`, which KDA's own inputs cannot
    /// express.
    pub fn new(
        gpu: &'g Gpu,
        d: KdaDims,
        x: &KdaRefs<'_, f64>,
        opts: &KdaOptions,
        d_o: &ArrayD<f64>,
        dht: Option<&ArrayD<f64>>,
        storage: Dtype,
    ) -> Result<Problem<'g>> {
        check_sizes(d.k, d.v, d.b * d.t)?;
        let scale = opts.scale.unwrap_or(1.0 / (d.k as f64).sqrt()) as f32;
        let up = |what: &str, a: &ArrayD<f64>| gpu.upload_input(what, a, storage);
        let up32 =
            |what: &str, a: Option<&ArrayD<f64>>| a.map(|a| gpu.upload_f32(what, a)).transpose();
        let (raw_q, raw_k, raw_v, raw_g, raw_beta, raw_do) = (
            up("q", x.q)?,
            up("k", x.k)?,
            up("v", x.v)?,
            up("g", x.g)?,
            up("beta", x.beta)?,
            up("do", d_o)?,
        );
        let ntok = d.b * d.t;
        let z = |what: &str, n: usize| gpu.zeros::<f32>(what, n);
        let mut p = Problem {
            gpu,
            d,
            storage,
            opts: *opts,
            scale,
            a_log: up32("A_log", x.a_log)?,
            dt_bias: up32("dt_bias", x.dt_bias)?,
            h0: up32("initial_state", x.initial_state)?,
            dht: up32("dht", dht)?,
            q: z("q", ntok * d.h * d.k)?,
            k: z("k", ntok * d.h * d.k)?,
            v: z("v", ntok * d.hv * d.v)?,
            g: z("g", ntok * d.hv * d.k)?,
            beta: z("beta", ntok * d.hv)?,
            d_o: z("do", ntok * d.hv * d.v)?,
            raw_q,
            raw_k,
            raw_g,
            raw_beta,
        };
        p.prepare(&raw_v, &raw_do)?;
        Ok(p)
    }

    pub fn tokens(&self) -> usize {
        self.d.b * self.d.t
    }

    /// The pre-processing module reads inputs in their storage dtype.
    fn defines(&self) -> Defines {
        prep_defines(self.storage)
    }

    /// Runs the fused pre-processing kernels.
    fn prepare(&mut self, raw_v: &Input, raw_do: &Input) -> Result<()> {
        let (gpu, d, ntok) = (self.gpu, self.d, self.tokens());
        let defs = self.defines();
        let rows = |f: &'static str| gpu.function(&PREP, defs, f);
        let l2 = i32::from(self.opts.use_qk_l2norm_in_kernel);
        let nrows = (ntok * d.h) as i64;
        let kd = d.k as i32;
        let f = rows("prep_rows")?;
        for (raw, out, scale) in [
            (&self.raw_q, &mut self.q, self.scale),
            (&self.raw_k, &mut self.k, 1.0f32),
        ] {
            let mut b = gpu.stream().launch_builder(&f);
            arg_in(&mut b, raw);
            b.arg(out).arg(&nrows).arg(&kd).arg(&l2).arg(&scale);
            gpu.launch(b, "prep_rows", elementwise(ntok * d.h))?;
        }
        let to_f32 = rows("to_f32")?;
        for (raw, out) in [(raw_v, &mut self.v), (raw_do, &mut self.d_o)] {
            let n = (ntok * d.hv * d.v) as i64;
            let mut b = gpu.stream().launch_builder(&to_f32);
            arg_in(&mut b, raw);
            b.arg(out).arg(&n);
            gpu.launch(b, "to_f32", elementwise(n as usize))?;
        }
        let (kind, lb) = gate_code(self.opts.gate);
        let (n, hv, scalar) = (
            (ntok * d.hv * d.k) as i64,
            d.hv as i32,
            i32::from(d.scalar_gate),
        );
        let f = rows("prep_gate")?;
        let mut b = gpu.stream().launch_builder(&f);
        arg_in(&mut b, &self.raw_g);
        arg_opt(&mut b, self.a_log.as_ref());
        arg_opt(&mut b, self.dt_bias.as_ref());
        b.arg(&mut self.g)
            .arg(&n)
            .arg(&hv)
            .arg(&kd)
            .arg(&scalar)
            .arg(&kind)
            .arg(&lb);
        gpu.launch(b, "prep_gate", elementwise(n as usize))?;
        let (nb, sig, c) = (
            (ntok * d.hv) as i64,
            i32::from(self.opts.use_beta_sigmoid_in_kernel),
            beta_factor(&self.opts),
        );
        let f = rows("prep_beta")?;
        let mut b = gpu.stream().launch_builder(&f);
        arg_in(&mut b, &self.raw_beta);
        b.arg(&mut self.beta).arg(&nb).arg(&sig).arg(&c);
        gpu.launch(b, "prep_beta", elementwise(nb as usize))
    }

    /// dq or dk per value head → per q/k head, through l2norm.
    fn chain_qk(
        &self,
        per_hv: &CudaSlice<f32>,
        raw: &Input,
        factor: f32,
    ) -> Result<CudaSlice<f32>> {
        let (gpu, d, ntok) = (self.gpu, self.d, self.tokens());
        let mut out = gpu.zeros::<f32>("dq/dk", ntok * d.h * d.k)?;
        let f = gpu.function(&PREP, self.defines(), "group_l2norm_bwd")?;
        let (rows, h, g, k, l2) = (
            (ntok * d.h) as i64,
            d.h as i32,
            d.groups() as i32,
            d.k as i32,
            i32::from(self.opts.use_qk_l2norm_in_kernel),
        );
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(per_hv);
        arg_in(&mut b, raw);
        b.arg(&mut out)
            .arg(&rows)
            .arg(&h)
            .arg(&g)
            .arg(&k)
            .arg(&l2)
            .arg(&factor);
        gpu.launch(b, "group_l2norm_bwd", elementwise(ntok * d.h))?;
        Ok(out)
    }

    /// Through the gate: `(dg shaped like g, dA_log, ddt_bias)`. A scalar
    /// gate's gradient is the sum of the per-key ones; its in-kernel gate
    /// (GDN) then works on one element per head (`K = 1`).
    fn chain_gate(&self, dgate: CudaSlice<f32>) -> Result<GateGrads> {
        let (gpu, d, ntok) = (self.gpu, self.d, self.tokens());
        let defs = self.defines();
        let (dgate, k) = if d.scalar_gate {
            let mut dg = gpu.zeros::<f32>("dg", ntok * d.hv)?;
            let f = gpu.function(&PREP, defs, "scalar_gate_bwd")?;
            let (m, k) = ((ntok * d.hv) as i64, d.k as i32);
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(&dgate).arg(&mut dg).arg(&m).arg(&k);
            gpu.launch(b, "scalar_gate_bwd", elementwise(ntok * d.hv))?;
            (dg, 1)
        } else {
            (dgate, d.k)
        };
        if self.opts.gate == Gate::None {
            return Ok((dgate, None, None));
        }
        let n = ntok * d.hv * k;
        let mut dg = gpu.zeros::<f32>("dg", n)?;
        let mut da_elem = gpu.zeros::<f32>("dA_log terms", n)?;
        let (kind, lb) = gate_code(self.opts.gate);
        let (nn, hv, kk) = (n as i64, d.hv as i32, k as i32);
        let f = gpu.function(&PREP, defs, "gate_bwd")?;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&dgate);
        arg_in(&mut b, &self.raw_g);
        arg_opt(&mut b, self.a_log.as_ref());
        arg_opt(&mut b, self.dt_bias.as_ref());
        b.arg(&mut dg)
            .arg(&mut da_elem)
            .arg(&nn)
            .arg(&hv)
            .arg(&kk)
            .arg(&kind)
            .arg(&lb);
        gpu.launch(b, "gate_bwd", elementwise(n))?;
        let ddt = self
            .dt_bias
            .as_ref()
            .map(|_| gpu.zeros::<f32>("ddt_bias", d.hv * k))
            .transpose()?;
        let da = self
            .a_log
            .as_ref()
            .map(|_| gpu.zeros::<f32>("dA_log", d.hv))
            .transpose()?;
        let f = gpu.function(&PREP, defs, "gate_param_grads")?;
        let bt = ntok as i64;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&dg).arg(&da_elem);
        arg_opt(&mut b, ddt.as_ref());
        arg_opt(&mut b, da.as_ref());
        b.arg(&bt).arg(&hv).arg(&kk);
        gpu.launch(
            b,
            "gate_param_grads",
            crate::device::grid(d.hv, 1, k.min(1024), k * 8),
        )?;
        Ok((dg, da, ddt))
    }

    fn chain_beta(&self, dbeta: CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        if !self.opts.use_beta_sigmoid_in_kernel {
            return Ok(dbeta);
        }
        let (gpu, n) = (self.gpu, self.tokens() * self.d.hv);
        let mut out = gpu.zeros::<f32>("dbeta", n)?;
        let f = gpu.function(&PREP, self.defines(), "beta_bwd")?;
        let (nn, c) = (n as i64, beta_factor(&self.opts));
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&dbeta);
        arg_in(&mut b, &self.raw_beta);
        b.arg(&mut out).arg(&nn).arg(&c);
        gpu.launch(b, "beta_bwd", elementwise(n))?;
        Ok(out)
    }

    /// Gradients with respect to the inputs, from the per-head gradients.
    fn chain(
        &self,
        g: Grads,
        dh0: CudaSlice<f32>,
        x: &KdaRefs<'_, f64>,
        [dq_host, dk_host, dv_host, dg_host, dbeta_host]: [Vec<f64>; 5],
    ) -> Result<KdaGrads<f64>> {
        let dq = self.chain_qk(&g.dq, &self.raw_q, self.scale)?;
        let dk = self.chain_qk(&g.dk, &self.raw_k, 1.0)?;
        let (dg, da_log, ddt_bias) = self.chain_gate(g.dg)?;
        let dbeta = self.chain_beta(g.dbeta)?;
        let fetch = |what: &str, t: CudaSlice<f32>, shape: &[usize], round: bool| {
            self.gpu
                .fetch(what, t, shape, round.then_some(self.storage))
        };
        let token = |what: &str, t: CudaSlice<f32>, like: &ArrayD<f64>, out: Vec<f64>| {
            let round = Some(self.storage);
            self.gpu.fetch_into(what, t, like.shape(), round, out)
        };
        let shape_of = |a: &ArrayD<f64>| a.shape().to_vec();
        Ok(KdaGrads {
            dq: token("dq", dq, x.q, dq_host)?,
            dk: token("dk", dk, x.k, dk_host)?,
            dv: token("dv", g.dv, x.v, dv_host)?,
            dg: token("dg", dg, x.g, dg_host)?,
            dbeta: token("dbeta", dbeta, x.beta, dbeta_host)?,
            da_log: match (da_log, x.a_log) {
                (Some(t), Some(a)) => Some(fetch("dA_log", t, &shape_of(a), false)?),
                _ => None,
            },
            ddt_bias: match (ddt_bias, x.dt_bias) {
                (Some(t), Some(a)) => Some(fetch("ddt_bias", t, &shape_of(a), false)?),
                _ => None,
            },
            dh0: match x.initial_state {
                Some(h) => Some(fetch("dh0", dh0, &shape_of(h), false)?),
                None => None,
            },
        })
    }
}

type GateGrads = (
    CudaSlice<f32>,
    Option<CudaSlice<f32>>,
    Option<CudaSlice<f32>>,
);

/// KDA forward and backward on the GPU from inputs borrowed where they
/// live (`KdaInputs::refs`, or a case's tensors, uncopied): `o`,
/// `final_state` and every gradient (shaped like the oracle's), with kernel
/// and host timings.
pub fn run(
    gpu: &Gpu,
    x: &KdaRefs<'_, f64>,
    opts: &KdaOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    imp: &GpuImpl,
) -> Result<Run<KdaOutputs<f64>, KdaGrads<f64>>> {
    let t = std::time::Instant::now();
    let d = x.validate(opts)?;
    d.validate_upstream(d_o, dht)?;
    let checked_s = t.elapsed().as_secs_f64();
    let mut run = run_validated(gpu, d, x, opts, d_o, dht, imp)?;
    // Checking the inputs is part of getting them onto the device.
    run.timings.upload_s += checked_s;
    run.timings.check_s = checked_s;
    Ok(run)
}

/// [`run`] on a problem the caller validated (`d` its sizes; see
/// [`Problem::new`]).
pub(crate) fn run_validated(
    gpu: &Gpu,
    d: KdaDims,
    x: &KdaRefs<'_, f64>,
    opts: &KdaOptions,
    d_o: &ArrayD<f64>,
    dht: Option<&ArrayD<f64>>,
    imp: &GpuImpl,
) -> Result<Run<KdaOutputs<f64>, KdaGrads<f64>>> {
    let compiled = gpu.compile_seconds();
    let t = std::time::Instant::now();
    let p = Problem::new(gpu, d, x, opts, d_o, dht, imp.storage)?;
    gpu.sync("KDA inputs")?;
    let upload_s = t.elapsed().as_secs_f64();
    let mut run = match imp.engine {
        Engine::Naive => run_with(&naive::Naive { p: &p }, &p, x, imp),
        Engine::Chunk(c) => run_with(&chunk::Chunked::new(&p, c)?, &p, x, imp),
    }?;
    run.timings.upload_s = upload_s;
    run.timings.compile_s = gpu.compile_seconds() - compiled;
    Ok(run)
}

fn run_with<R: Recurrence<Grads = Grads>>(
    rec: &R,
    p: &Problem,
    x: &KdaRefs<'_, f64>,
    imp: &GpuImpl,
) -> Result<Run<KdaOutputs<f64>, KdaGrads<f64>>> {
    let (gpu, d) = (p.gpu, p.d);
    let mut o = gpu.zeros::<f32>("o", p.tokens() * d.hv * d.v)?;
    std::thread::scope(|s| {
        // The results' host memory, mapped on the other cores meanwhile
        // (see `mapped_zeros`).
        let lens = [x.v, x.q, x.k, x.v, x.g, x.beta].map(|t| t.len());
        let landing = s.spawn(move || lens.map(mapped_zeros));
        let (batch, io) = ((d.b, d.t, x.cu_seqlens), (p.h0.as_ref(), p.dht.as_ref()));
        let ph = cp::forward_backward(rec, "KDA", batch, imp.cp.as_ref(), io, &mut o)?;
        let t = std::time::Instant::now();
        let [o_host, grads_host @ ..] = landing.join().expect("mapping the results' memory");
        let grads = p.chain(ph.grads, ph.dh0, x, grads_host)?;
        let outputs = KdaOutputs {
            o: gpu.fetch_into("o", o, x.v.shape(), Some(p.storage), o_host)?,
            final_state: Some(gpu.fetch("final_state", ph.ht, &[d.n, d.hv, d.k, d.v], None)?),
        };
        gpu.sync("KDA results")?;
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
