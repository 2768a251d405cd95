//! The implementation registry: which code computes a case's outputs and
//! gradients (`--impl`). Every implementation returns the same name → tensor
//! map, so any two can be compared.

use std::borrow::Cow;

use deltaref::cp::{CpOptions, Layout, PlanSpec, RankDiag};
use deltaref::precision::{Feature, Policy, Stage};
use deltaref::registry::Job;
pub use deltaref::registry::{ChunkSize, EngineKind as Engine};
use deltaref::Dtype;
use deltaref_gpu::{GpuImpl, Timings};

use crate::case::{Case, CaseError, CpLayout, Op};
pub use crate::compute::{Compute, ComputeError};
use crate::memory::Run;
use crate::outputs::Tensors;

/// `--impl`: an implementation family by its command-line name; parses and
/// prints itself (clap takes it through [`FromStr`](std::str::FromStr)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ImplName {
    /// The oracle's naive recurrence.
    #[default]
    Naive,
    /// The oracle's chunked form.
    Chunk,
    /// Simulated context parallel in the oracle's code.
    Cp,
    GpuNaive,
    GpuChunk,
    GpuCp,
}

impl ImplName {
    pub const ALL: [ImplName; 6] = [
        ImplName::Naive,
        ImplName::Chunk,
        ImplName::Cp,
        ImplName::GpuNaive,
        ImplName::GpuChunk,
        ImplName::GpuCp,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ImplName::Naive => "naive",
            ImplName::Chunk => "chunk",
            ImplName::Cp => "cp",
            ImplName::GpuNaive => "gpu-naive",
            ImplName::GpuChunk => "gpu-chunk",
            ImplName::GpuCp => "gpu-cp",
        }
    }

    /// The CUDA kernels rather than the oracle's code.
    pub fn on_gpu(self) -> bool {
        matches!(
            self,
            ImplName::GpuNaive | ImplName::GpuChunk | ImplName::GpuCp
        )
    }

    pub fn is_cp(self) -> bool {
        matches!(self, ImplName::Cp | ImplName::GpuCp)
    }

    /// The local engine a non-CP implementation names (CP's is `--cp-engine`'s).
    fn engine(self) -> Option<EngineName> {
        match self {
            ImplName::Naive | ImplName::GpuNaive => Some(EngineName::Naive),
            ImplName::Chunk | ImplName::GpuChunk => Some(EngineName::Chunk),
            ImplName::Cp | ImplName::GpuCp => None,
        }
    }
}

/// `--cp-engine`: the local engine of each CP rank, by name; parses and
/// prints itself like [`ImplName`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineName {
    Naive,
    Chunk,
}

impl EngineName {
    pub fn name(self) -> &'static str {
        match self {
            EngineName::Naive => "naive",
            EngineName::Chunk => "chunk",
        }
    }
}

impl std::fmt::Display for EngineName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for EngineName {
    type Err = String;
    fn from_str(s: &str) -> Result<EngineName, String> {
        [EngineName::Naive, EngineName::Chunk]
            .into_iter()
            .find(|e| e.name() == s)
            .ok_or_else(|| format!("unknown --cp-engine `{s}` (available: naive, chunk)"))
    }
}

impl std::fmt::Display for ImplName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ImplName {
    type Err = String;
    fn from_str(s: &str) -> Result<ImplName, String> {
        ImplName::ALL
            .into_iter()
            .find(|n| n.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown --impl `{s}` (available: {})",
                    ImplName::ALL.map(ImplName::name).join(", ")
                )
            })
    }
}

/// Where an implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The oracle's code, in f64 or f32.
    Cpu,
    /// The CUDA kernels; inputs stored as given, or (`None`) in the dtype
    /// the case stores them in.
    Gpu(Option<Dtype>),
}

/// An implementation of all three operators: an engine, optionally under
/// simulated CP, optionally with emulated storage precisions, on the CPU
/// (the oracle's code) or the GPU (the CUDA kernels).
#[derive(Clone, Debug, PartialEq)]
pub struct Impl {
    pub engine: Engine,
    pub cp: Option<(PlanSpec, CpOptions)>,
    /// Stage rounding of the chunked engine (the CP rounding lives in `cp`).
    pub policy: Policy,
    pub device: Device,
}

impl Impl {
    pub const NAIVE: Impl = Impl {
        engine: Engine::Naive,
        cp: None,
        policy: Policy {
            stages: vec![],
            exp2: false,
            safe_gate_midpoint: false,
            safe_gate_bound: None,
            midpoint_stride_fault: false,
            jitter: None,
        },
        device: Device::Cpu,
    };

    pub fn chunk(chunk_size: usize) -> Result<Impl, CaseError> {
        let c = ChunkSize::new(chunk_size)
            .map_err(|e| CaseError::Usage(format!("--chunk-size: {e}")))?;
        Ok(Impl {
            engine: Engine::Chunk(c),
            ..Impl::NAIVE
        })
    }

    /// The same implementation as one member of the ensemble of correct
    /// kernels ([`deltaref::precision::Jitter`]): every stage it stores,
    /// CP's included, is jittered before rounding.
    pub fn jittered(&self, jitter: deltaref::precision::Jitter) -> Impl {
        let mut imp = self.clone();
        imp.policy = imp.policy.jittered(jitter);
        if let Some((_, o)) = imp.cp.as_mut() {
            o.policy = o.policy.clone().jittered(jitter);
        }
        imp
    }

    pub fn name(&self) -> String {
        let engine = match &self.engine {
            Engine::Naive => "naive".to_string(),
            Engine::Chunk(c) => format!("chunk(C={c})"),
        };
        let (prefix, storage) = match self.device {
            Device::Cpu => ("", String::new()),
            Device::Gpu(s) => (
                "gpu-",
                s.map_or(String::new(), |s| format!(", {}", s.name())),
            ),
        };
        match &self.cp {
            None => format!("{prefix}{engine}{storage}"),
            Some((plan, _)) => format!("{prefix}cp({plan}, {engine}{storage})"),
        }
    }

    /// Refuses (before the run allocates) when running on the borrowed
    /// `case` would take the process over the budget of [`crate::memory`]:
    /// the case held (inputs and any stored truth), one set of results
    /// beside it (a truth or another run's) and the run itself.
    pub fn check_memory(&self, case: &Case) -> Result<(), CaseError> {
        self.check_memory_with(case, case.bytes().saturating_add(case.result_bytes()))
    }

    /// [`Impl::check_memory`] for a case the run consumes
    /// ([`Impl::compute_owned`]): its inputs are the run's own copy, and
    /// `truth_held` says whether a truth computed before it stays alive.
    pub fn check_memory_owned(&self, case: &Case, truth_held: bool) -> Result<(), CaseError> {
        self.check_memory_with(case, if truth_held { case.result_bytes() } else { 0 })
    }

    fn check_memory_with(&self, case: &Case, held: u64) -> Result<(), CaseError> {
        crate::memory::check(
            &format!("impl:{} on this case", self.name()),
            self.memory_needed(case).saturating_add(held),
        )
    }

    /// The bytes a CPU run on `case` holds at its peak, its own copy of the
    /// inputs and its results included ([`crate::memory::Problem::compute_bytes`]
    /// for this engine and CP plan), without [`crate::memory::fixed_bytes`].
    pub fn memory_needed(&self, case: &Case) -> u64 {
        let p = crate::memory::Problem::of_case(case);
        p.compute_bytes(self.run_shape(case, &p))
    }

    /// How the run goes on `case` (problem `p`), for its memory estimate:
    /// the chunked engine's longest piece is a CP interval's (the whole
    /// batch's T where the plan does not build: the run then refuses the
    /// case itself).
    fn run_shape(&self, case: &Case, p: &crate::memory::Problem) -> Run {
        let Engine::Chunk(chunk_size) = self.engine else {
            return Run::Naive;
        };
        let chunk_size = chunk_size.get();
        if self.device != Device::Cpu {
            return Run::Naive;
        }
        let (piece, pieces) = self
            .cp
            .as_ref()
            .and_then(|(spec, _)| {
                let plan = spec.build(p.b, p.t, case.cu_seqlens.as_deref()).ok()?;
                let longest = plan.bounds.windows(2).map(|w| w[1] - w[0]).max()?;
                Some((longest, plan.ranks.len()))
            })
            .unwrap_or((p.t, 1));
        Run::Chunk {
            chunk_size,
            piece,
            pieces,
        }
    }

    /// Outputs and gradients of `case`'s inputs and upstream gradients
    /// (`compute` picks the oracle's scalar; the GPU computes in f32).
    pub fn compute(&self, case: &Case, compute: Compute) -> Result<Tensors, ComputeError> {
        Ok(self.timed_compute(case, compute)?.0)
    }

    /// Like `compute`, with the device time of GPU runs (`None` on the CPU).
    pub fn timed_compute(
        &self,
        case: &Case,
        compute: Compute,
    ) -> Result<(Tensors, Option<Timings>), ComputeError> {
        if let Device::Gpu(storage) = self.device {
            let imp = GpuImpl {
                engine: match self.engine {
                    Engine::Naive => deltaref_gpu::Engine::Naive,
                    Engine::Chunk(c) => deltaref_gpu::Engine::Chunk(c.get()),
                },
                cp: self.cp.as_ref().map(|(p, _)| p.clone()),
                storage: storage.unwrap_or_else(|| crate::gpu::case_storage(case)),
            };
            let (t, timings) = crate::gpu::case(&imp, case)?;
            return Ok((t, Some(timings)));
        }
        Ok((
            self.compute_in(Cow::Borrowed(case), compute, false)?.0,
            None,
        ))
    }

    /// Like `compute` in f64, with the per-rank CP diagnostics (empty without CP).
    pub fn compute_with_diags(
        &self,
        case: &Case,
    ) -> Result<(Tensors, Vec<RankDiag<f64>>), deltaref::Error> {
        self.compute_in(Cow::Borrowed(case), Compute::F64, true)
    }

    /// Like `compute_with_diags`, consuming the case (see `compute_owned`).
    pub fn compute_owned_with_diags(
        &self,
        case: Case,
    ) -> Result<(Tensors, Vec<RankDiag<f64>>), deltaref::Error> {
        self.compute_in(Cow::Owned(case), Compute::F64, true)
    }

    /// Like `compute` in `compute`, with the per-rank CP diagnostics of
    /// that run (widened to f64; empty without CP): an f32 or preset run's
    /// merged states against the same engine's non-CP states at its own
    /// precision. `owned`: the case is consumed (see `compute_owned`).
    pub fn compute_with_diags_in(
        &self,
        case: Cow<'_, Case>,
        compute: Compute,
    ) -> Result<(Tensors, Vec<RankDiag<f64>>), deltaref::Error> {
        self.compute_in(case, compute, true)
    }

    /// Like `compute`, consuming the case: its inputs move into the engine
    /// instead of being copied (a long case's head block holds one set).
    pub fn compute_owned(&self, case: Case, compute: Compute) -> Result<Tensors, ComputeError> {
        if let Device::Gpu(_) = self.device {
            return self.compute(&case, compute);
        }
        Ok(self.compute_in(Cow::Owned(case), compute, false)?.0)
    }

    /// The outputs only (`o`/`y` and the final state), without the backward
    /// pass: the case needs no upstream gradients. (The GPU runs both passes.)
    pub fn compute_forward(&self, case: &Case, compute: Compute) -> Result<Tensors, ComputeError> {
        if let Device::Gpu(_) = self.device {
            let mut t = self.compute(case, compute)?;
            t.retain(|n, _| case.meta.op.forward_results().contains(&n.as_str()));
            return Ok(t);
        }
        let t = self.forward_in(case, compute)?;
        Ok(self.stored_outputs(case.meta.op, t))
    }

    fn forward_in(&self, case: &Case, compute: Compute) -> Result<Tensors, deltaref::Error> {
        let case = self.stored_inputs(Cow::Borrowed(case));
        let cp = self.cp_without_references();
        let job = self.job(compute, cp.as_ref());
        case.meta.op.entry().forward(&job, case.problem())
    }

    /// The op's stored intermediates ([`crate::intermediates`]) of this
    /// run, with the chunk layout.
    pub fn intermediates(
        &self,
        case: &Case,
        compute: Compute,
    ) -> Result<(Tensors, Vec<deltaref::registry::ChunkPos>), deltaref::Error> {
        let case = self.stored_inputs(Cow::Borrowed(case));
        let job = self.job(compute, self.cp.as_ref());
        let up = case.upstream_refs()?;
        case.meta.op.entry().intermediates(&job, case.problem(), up)
    }

    /// The registry's description of this run.
    fn job<'a>(&'a self, compute: Compute, cp: Option<&'a (PlanSpec, CpOptions)>) -> Job<'a> {
        Job {
            engine: self.engine,
            compute,
            policy: &self.policy,
            cp: cp.map(|(p, o)| (p, o)),
        }
    }

    /// The results as the kernel hands them back: the output and the
    /// gradients rounded to the policy's output storage (FLA returns them
    /// in the token dtype), except those the op's kernels return in fp32
    /// (its entry's `fp32_results`: final states, `dh0`, `dA_log`, …).
    fn stored_outputs(&self, op: Op, mut t: Tensors) -> Tensors {
        if let Some(s) = self.policy.store(Stage::Outputs) {
            let fp32 = op.info().fp32_results;
            for (_, x) in t.iter_mut().filter(|(n, _)| !fp32.contains(&n.as_str())) {
                x.mapv_inplace(|v| s.round(v));
            }
        }
        t
    }

    /// The case as the kernel reads it: inputs rounded to the policy's
    /// input storage, the gate to its own ([`Stage::GateInput`]) when the
    /// policy gives it one.
    fn stored_inputs<'a>(&self, case: Cow<'a, Case>) -> Cow<'a, Case> {
        // The gate as stored, from the case's own values (not bf16 first).
        let gate = self
            .policy
            .storage(Stage::GateInput)
            .zip(gate_input(case.meta.op))
            .and_then(|(d, name)| {
                let g = case.tensors.get(name)?;
                Some((name, g.mapv(|x| d.round_f64(x))))
            });
        let rounded = match self.policy.storage(Stage::Inputs) {
            Some(s) => Cow::Owned(case.with_rounded_inputs(|x| s.round_f64(x))),
            None => case,
        };
        let Some((name, g)) = gate else {
            return rounded;
        };
        let mut c = rounded.into_owned();
        c.tensors.insert(name.into(), g);
        Cow::Owned(c)
    }

    /// The CP plan and options without the per-rank table's non-CP
    /// reference runs (results only: they would cost world/2 extra passes).
    fn cp_without_references(&self) -> Option<(PlanSpec, CpOptions)> {
        self.cp.as_ref().map(|(p, o)| {
            let o = CpOptions {
                skip_reference_runs: true,
                ..o.clone()
            };
            (p.clone(), o)
        })
    }

    /// `diags`: the per-rank table is wanted, non-CP references included.
    fn compute_in(
        &self,
        case: Cow<'_, Case>,
        compute: Compute,
        diags: bool,
    ) -> Result<(Tensors, Vec<RankDiag<f64>>), deltaref::Error> {
        let cp = if diags {
            self.cp.clone()
        } else {
            self.cp_without_references()
        };
        let case = self.stored_inputs(case);
        let (op, options) = (case.meta.op, case.meta.options.clone());
        // An owned case hands its tensors over; a borrowed one is copied.
        let (inputs, cu, d_o, dht) = match case {
            Cow::Owned(c) => c.into_inputs()?,
            Cow::Borrowed(c) => {
                let (d_o, dht) = c.upstream()?;
                (c.inputs(), c.cu_seqlens.clone(), d_o, dht)
            }
        };
        let job = self.job(compute, cp.as_ref());
        let (t, diags) = op
            .entry()
            .forward_backward(&job, inputs, cu, &options, (d_o, dht))?;
        Ok((self.stored_outputs(op, t), diags))
    }
}

/// FLA's equal split of `world` ranks in `layout`.
fn world_plan(world: usize, layout: Layout) -> PlanSpec {
    match layout {
        Layout::Contiguous => PlanSpec::World(world),
        Layout::Zigzag => PlanSpec::Zigzag(world),
    }
}

/// FLA's chunk size (`chunk_kda`'s `BT`), used when neither the flag nor the case gives one.
pub const DEFAULT_CHUNK_SIZE: usize = 64;

/// What `--impl` and its flags say, before the case is known.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImplRequest {
    pub name: ImplName,
    /// The chunked engine's chunk size (default: the case's, else
    /// [`DEFAULT_CHUNK_SIZE`]).
    pub chunk_size: Option<usize>,
    pub world: Option<usize>,
    /// FLA's layout of `world` (contiguous unless given).
    pub layout: Option<Layout>,
    pub cuts: Option<Vec<usize>>,
    /// The ranks' engine (default chunk: FLA's kernels are chunked; DPLR's
    /// gpu-cp naive, its only GPU kernels).
    pub cp_engine: Option<EngineName>,
    pub cp_options: CpOptions,
    pub policy: Policy,
    /// A named preset (see `presets`): sets the policy, CP faults and compute.
    pub precision: Option<String>,
    /// GPU input storage (default: the case's input dtype).
    pub gpu_dtype: Option<Dtype>,
}

impl ImplRequest {
    /// The oracle's chunked engine in the case's own layout: CP when the case
    /// has a `cp` layout, plain chunked otherwise (the structure whose
    /// intermediates FLA stores, and the noise reference of a candidate).
    pub fn chunked_for(case: &Case) -> ImplRequest {
        ImplRequest {
            name: if case.meta.cp.is_some() {
                ImplName::Cp
            } else {
                ImplName::Chunk
            },
            ..ImplRequest::default()
        }
    }

    /// Resolves against a case (whose metadata may carry a CP layout and
    /// chunk size); returns the compute scalar a preset asks for, if any.
    pub fn resolve_with_compute(&self, case: &Case) -> Result<(Impl, Option<Compute>), CaseError> {
        let Some(name) = &self.precision else {
            return Ok((self.resolve(case)?, None));
        };
        let v = case.value_dim();
        let p = crate::presets::parse(name, v).map_err(CaseError::Usage)?;
        if self.name.on_gpu() {
            return Err(CaseError::Usage(format!(
                "--precision emulates storage precisions in the oracle's code; the GPU kernels \
                 have their own (use --gpu-dtype), drop --precision with --impl {}",
                self.name
            )));
        }
        if p.faults != Default::default() && self.name != ImplName::Cp {
            return Err(CaseError::Usage(format!(
                "--precision {name} injects a CP fault: use it with --impl cp"
            )));
        }
        if !p.ops.is_empty() && !p.ops.contains(&case.meta.op) {
            let ops: Vec<&str> = p.ops.iter().map(|o| o.name()).collect();
            return Err(CaseError::Usage(format!(
                "--precision {name} models a bug of FLA's {} code ({}); this case's op is {}, \
                 where it cannot apply",
                ops.join("/"),
                p.about,
                case.meta.op.name()
            )));
        }
        let bare = self.resolve(case)?;
        let policy = p.policy(crate::presets::Target {
            op: case.meta.op,
            options: &case.meta.options,
            cp: bare.cp.is_some(),
        });
        check_policy(name, &policy, case.meta.op, &bare)?;
        let req = ImplRequest {
            policy: policy.clone(),
            cp_options: CpOptions {
                policy,
                faults: p.faults,
                skip_reference_runs: false,
            },
            precision: None,
            ..self.clone()
        };
        Ok((req.resolve(case)?, Some(p.compute)))
    }

    /// The chunk size asked for, else the case's, else [`DEFAULT_CHUNK_SIZE`].
    pub fn chunk_size_for(&self, case: &Case) -> usize {
        self.chunk_size
            .or(case.meta.chunk_size)
            .unwrap_or(DEFAULT_CHUNK_SIZE)
    }

    /// Resolves against a case (whose metadata may carry a CP layout and chunk size).
    pub fn resolve(&self, case: &Case) -> Result<Impl, CaseError> {
        let usage = |m: String| CaseError::Usage(m);
        let chunk_size = self.chunk_size_for(case);
        let engine_of = |name: EngineName| match name {
            EngineName::Naive => Ok(Engine::Naive),
            EngineName::Chunk => Impl::chunk(chunk_size).map(|i| i.engine),
        };
        let cp_given = self.world.is_some()
            || self.layout.is_some()
            || self.cuts.is_some()
            || self.cp_engine.is_some();
        // An op with naive GPU kernels only (DPLR) runs them under gpu-cp by default.
        let gpu_chunked = deltaref_gpu::runner::engines(case.meta.op.name())
            .contains(&deltaref_gpu::runner::GpuEngine::Chunk);
        let engine_name = self.name.engine().unwrap_or_else(|| {
            self.cp_engine
                .unwrap_or(if self.name == ImplName::GpuCp && !gpu_chunked {
                    EngineName::Naive
                } else {
                    EngineName::Chunk
                })
        });
        if self.chunk_size.is_some() && engine_name == EngineName::Naive {
            return Err(usage(format!(
                "--chunk-size applies to the chunked engine; --impl {}{} runs the naive one",
                self.name,
                if self.name.is_cp() {
                    " --cp-engine naive"
                } else {
                    ""
                }
            )));
        }
        if self.gpu_dtype.is_some() && !self.name.on_gpu() {
            return Err(usage(
                "--gpu-dtype applies to the gpu-* implementations".into(),
            ));
        }
        match self.name {
            ImplName::Naive | ImplName::Chunk if cp_given => Err(usage(
                "--world/--layout/--cuts/--cp-engine need --impl cp".into(),
            )),
            ImplName::Naive | ImplName::Chunk => Ok(Impl {
                engine: engine_of(engine_name)?,
                cp: None,
                policy: self.policy.clone(),
                device: Device::Cpu,
            }),
            ImplName::GpuNaive | ImplName::GpuChunk if cp_given => Err(usage(
                "--world/--layout/--cuts/--cp-engine need --impl cp or gpu-cp".into(),
            )),
            ImplName::GpuNaive | ImplName::GpuChunk => {
                let engine = engine_of(engine_name)?;
                gpu_engine_supported(case.meta.op, &engine)?;
                Ok(Impl {
                    engine,
                    cp: None,
                    policy: Policy::exact(),
                    device: Device::Gpu(self.gpu_dtype),
                })
            }
            ImplName::Cp | ImplName::GpuCp => {
                let plan = match (self.world, &self.cuts, &case.meta.cp) {
                    (Some(_), Some(_), _) => {
                        return Err(usage("give --world or --cuts, not both".into()))
                    }
                    (_, Some(_), _) if self.layout.is_some() => {
                        return Err(usage(
                            "--layout applies to --world (FLA's equal split), not to --cuts".into(),
                        ))
                    }
                    (Some(w), None, _) => world_plan(w, self.layout.unwrap_or_default()),
                    (None, Some(c), _) => PlanSpec::Cuts(c.clone()),
                    (None, None, Some(CpLayout::World(w, layout))) => {
                        world_plan(*w, self.layout.unwrap_or(*layout))
                    }
                    (None, None, Some(CpLayout::Cuts(_))) if self.layout.is_some() => {
                        return Err(usage(
                            "--layout applies to --world: the case's CP layout is explicit cuts"
                                .into(),
                        ))
                    }
                    (None, None, Some(CpLayout::Cuts(c))) => PlanSpec::Cuts(c.clone()),
                    (None, None, None) => return Err(usage(
                        "--impl cp needs --world N or --cuts a,b,c (the case has no `cp` layout)"
                            .into(),
                    )),
                };
                let engine = engine_of(engine_name)?;
                if self.name == ImplName::Cp {
                    return Ok(Impl {
                        engine,
                        cp: Some((plan, self.cp_options.clone())),
                        policy: self.policy.clone(),
                        device: Device::Cpu,
                    });
                }
                gpu_engine_supported(case.meta.op, &engine)?;
                Ok(Impl {
                    engine,
                    cp: Some((plan, CpOptions::default())),
                    policy: Policy::exact(),
                    device: Device::Gpu(self.gpu_dtype),
                })
            }
        }
    }
}

/// The name of `op`'s gate input (`g`; DPLR `gk`), if it has one.
pub fn gate_input(op: Op) -> Option<&'static str> {
    ["g", "gk"].into_iter().find(|g| op.inputs().contains(g))
}

/// Refuses an engine the GPU kernels of `op` lack.
fn gpu_engine_supported(op: Op, engine: &Engine) -> Result<(), CaseError> {
    let engine = match engine {
        Engine::Naive => deltaref_gpu::Engine::Naive,
        Engine::Chunk(c) => deltaref_gpu::Engine::Chunk(c.get()),
    };
    deltaref_gpu::runner::supports(op.name(), engine).map_err(CaseError::Usage)
}

/// What a policy may ask of `imp` on `op`: the inputs and outputs (the
/// driver rounds them for every CPU engine), the engine's own stages, and
/// CP's stages under CP. The GPU kernels have their own precisions: nothing.
pub fn supported(op: Op, imp: &Impl) -> Vec<Feature> {
    if let Device::Gpu(_) = imp.device {
        return vec![];
    }
    let mut f = vec![
        Feature::Round(Stage::Inputs),
        Feature::Round(Stage::Outputs),
    ];
    f.extend(gate_input(op).map(|_| Feature::Round(Stage::GateInput)));
    f.extend(op.entry().features(imp.engine));
    if imp.cp.is_some() && op.is_delta_rule() {
        f.extend(deltaref::cp::FEATURES);
    }
    f
}

/// Refuses `policy` (of preset `name`) on `imp` when it asks for a feature
/// the engine does not implement: naming the feature and the engine.
pub fn check_policy(name: &str, policy: &Policy, op: Op, imp: &Impl) -> Result<(), CaseError> {
    let have = supported(op, imp);
    let Some(missing) = policy.features().into_iter().find(|f| !have.contains(f)) else {
        return Ok(());
    };
    let list = |f: &[Feature]| f.iter().map(|f| f.name()).collect::<Vec<_>>().join(", ");
    Err(CaseError::Usage(format!(
        "--precision {name} rounds `{}`, which the {} engine `{}` does not implement \
         (it implements: {}); nothing would change there, so this is refused",
        missing.name(),
        op.name(),
        imp.name(),
        if have.is_empty() {
            "nothing".to_string()
        } else {
            list(&have)
        },
    )))
}

/// The first non-finite value of `results`: `(tensor, flat index, value)`.
pub fn first_non_finite(results: &Tensors) -> Option<(String, usize, f64)> {
    results.iter().find_map(|(n, t)| {
        t.iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite())
            .map(|(i, v)| (n.clone(), i, *v))
    })
}

/// The truth of `case` (at `path`): the f64 oracle's outputs and gradients.
/// A non-finite result is the reference's failure (its inputs overflow
/// float64, e.g. an `A_log` or key norm that makes the decay or the delta
/// update blow up), reported as an input error rather than blamed on
/// whatever is compared with it.
pub fn oracle_truth(case: &Case, path: &std::path::Path) -> Result<Tensors, CaseError> {
    Impl::NAIVE.check_memory(case)?;
    let _p = crate::progress::Progress::spinner("computing the f64 oracle's truth");
    let truth = Impl::NAIVE
        .compute(case, Compute::F64)
        .map_err(CaseError::computing(path))?;
    finite_truth(truth, path)
}

/// [`oracle_truth`] consuming the case: its inputs move into the engine
/// instead of being copied (the memory check counts one set of results
/// held beside it: the run the truth is compared with).
pub fn oracle_truth_owned(case: Case, path: &std::path::Path) -> Result<Tensors, CaseError> {
    Impl::NAIVE.check_memory_owned(&case, true)?;
    let _p = crate::progress::Progress::spinner("computing the f64 oracle's truth");
    let truth = Impl::NAIVE
        .compute_owned(case, Compute::F64)
        .map_err(CaseError::computing(path))?;
    finite_truth(truth, path)
}

/// `truth`, refused when non-finite (see [`oracle_truth`]).
fn finite_truth(truth: Tensors, path: &std::path::Path) -> Result<Tensors, CaseError> {
    match first_non_finite(&truth) {
        None => Ok(truth),
        Some((n, i, v)) => Err(CaseError::Usage(format!(
            "{}: the f64 oracle's result is non-finite (`{n}` = {v} at flat index {i}): \
             the inputs overflow float64 in the recurrence (e.g. a huge A_log, gate or \
             key norm); this is a limit of the reference on these inputs, not a \
             candidate's fault",
            path.display()
        ))),
    }
}
