//! One module per subcommand: each exposes `Args` and `run(args) -> ExitCode`.
//! Exit codes: 0 success/all pass, 1 a comparison failed, 2 usage or input error.

pub mod band;
pub mod bench;
pub mod cp;
pub mod diagnose;
pub mod fixtures;
pub mod fuzz;
pub mod gen;
pub mod run;
pub mod selfcheck;
pub mod tolerance;
pub mod verify;

use std::process::ExitCode;

use clap::Args as ClapArgs;
use deltaref::cp::Layout;
use deltaref::Dtype;
use deltaref_verify::case::Case;
use deltaref_verify::case::CaseError;
use deltaref_verify::impls::{Compute, EngineName, Impl, ImplName, ImplRequest};

/// Subcommand `name`'s arguments for `--case case` and `rest`, parsed as
/// the command line would be (the CLI tests call the commands' `go` with
/// them). Panics on arguments clap refuses: a test's own mistake.
pub fn parse_case_args<A: ClapArgs>(name: &str, case: &std::path::Path, rest: &[&str]) -> A {
    #[derive(clap::Parser)]
    struct Cli<A: ClapArgs> {
        #[command(flatten)]
        a: A,
    }
    let head = [name, "--case", case.to_str().expect("UTF-8 path")];
    <Cli<A> as clap::Parser>::try_parse_from(head.iter().chain(rest))
        .expect("valid arguments")
        .a
}

/// `--convention NAME` for a case: a built-in convention that can express it.
pub fn convention(
    name: &str,
    case: &Case,
) -> Result<&'static deltaref_verify::convention::Convention, CaseError> {
    let conv = deltaref_verify::convention::find(name).ok_or_else(|| {
        CaseError::Usage(format!(
            "--convention: unknown `{name}` (available: {})",
            deltaref_verify::convention::names()
        ))
    })?;
    conv.check(case).map_err(CaseError::Usage)?;
    Ok(conv)
}

/// `--case`'s help, the same for every subcommand.
pub const CASE_HELP: &str =
    "The case file (safetensors from `deltaref gen`, `fixtures/`, or a port's own): \
     inputs, upstream gradients and optionally the expected results";

/// `--precision`'s help: every preset by name with what it emulates, read
/// off the preset list (so a new preset is explained where it is added).
pub fn precision_help() -> String {
    let names: Vec<String> = deltaref_verify::presets::presets()
        .iter()
        .map(|p| format!("`{}`: {}", p.name, p.about))
        .collect();
    format!(
        "Emulate a precision preset (what a kernel stores in which dtype, and \
         the scalar it computes in) or inject a CP fault; default exact. \
         PRESET+FAULT puts a fault under a preset's rounding (e.g. \
         fla-bf16+partial-merge-v); PRESET,STAGE=DTYPE,g=DTYPE,midpoint=on|off \
         changes stages of a preset (e.g. fla-bf16,S_ext=bf16,g=fp16,midpoint=off; \
         an unknown stage is refused with the valid ones). Presets: {}",
        names.join("; ")
    )
}

pub use deltaref_verify::report::impl_label;

/// `--against`: what a run is compared with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Against {
    // Plain comments: doc comments on values would switch clap's help to
    // its long layout; the flags' own help explains both values.
    // The truth: the case's stored results, else the f64 oracle.
    #[default]
    Truth,
    // The same engine, precision and compute run without context parallel
    // (FLA's CP tests): the difference is the CP path's alone.
    NonCp,
}

/// `--against non-cp`'s reference: `imp` (a CP implementation) run on
/// `case` without CP, same engine, precision and scalar (CP faults go with
/// CP); with `forward_only`, its forward alone. Returns the results and
/// the report's name for them.
pub fn non_cp_reference(
    imp: &Impl,
    case: &Case,
    precision: Option<&str>,
    compute: Compute,
    forward_only: bool,
) -> Result<(deltaref_verify::outputs::Tensors, String), CaseError> {
    if imp.cp.is_none() {
        return Err(CaseError::Usage(
            "--against non-cp compares a CP run with the same run without CP: give --impl cp \
             (or gpu-cp) with --world or --cuts, or a case with `cp` metadata"
                .into(),
        ));
    }
    let plain = Impl {
        cp: None,
        ..imp.clone()
    };
    plain.check_memory(case)?;
    let what = "(non-CP reference)";
    let t = if forward_only {
        plain.compute_forward(case, compute)
    } else {
        plain.compute(case, compute)
    }
    .map_err(CaseError::computing(std::path::Path::new(what)))?;
    let label = format!(
        "{} without CP",
        impl_label(&plain.name(), precision, compute)
    );
    Ok((t, label))
}

/// Warns on stderr about inputs outside their domain (a gate given in
/// linear space, …): the run goes on, the user is told.
pub fn warn_domain(case: &Case) {
    for w in case.domain_warnings() {
        eprintln!("warning: {w}");
    }
}

/// Prints to stdout; a closed pipe (`deltaref … | head`) is not an error.
pub fn print(s: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{s}");
}

/// Prints an error and returns exit code 2.
pub fn fail(e: &CaseError) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(2)
}

/// Parses a comma-separated list of non-negative integers.
pub fn list(flag: &str, s: &str) -> Result<Vec<usize>, CaseError> {
    s.split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| {
            CaseError::Usage(format!(
                "{flag}: expected comma-separated non-negative integers, got `{s}`"
            ))
        })
}

/// Refuses a tolerance that is NaN, infinite or negative (`flag` names it).
pub fn check_ratio(flag: &str, x: f64) -> Result<(), CaseError> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(CaseError::Usage(format!(
            "{flag}: expected a finite non-negative number, got {x}"
        )))
    }
}

/// `--impl` and its parameters.
#[derive(ClapArgs, Debug)]
pub struct ImplArgs {
    /// Implementation: naive, chunk or cp (simulated context parallel) in the
    /// oracle's code; gpu-naive, gpu-chunk or gpu-cp on the CUDA kernels.
    /// (`deltaref cp` always runs cp: there `naive`, the default, means cp.)
    #[arg(long = "impl", default_value = "naive")]
    pub imp: ImplName,
    /// Chunk size of the chunked engine: 16, 32 or 64 (default: the case's `chunk_size`, else 64).
    #[arg(long, value_parser = chunk_size)]
    pub chunk_size: Option<usize>,
    /// CP: FLA's equal split over N ranks (T must divide).
    #[arg(long)]
    pub world: Option<usize>,
    /// CP: FLA's layout of --world: contiguous (rank r holds slice r) or
    /// zigzag (2W equal intervals, rank r holds r and 2W−1−r).
    #[arg(long, value_enum)]
    pub layout: Option<LayoutArg>,
    /// CP: interior cut positions, e.g. 300,512,700.
    #[arg(long)]
    pub cuts: Option<String>,
    /// CP: local engine, naive or chunk (default chunk).
    #[arg(long, value_enum)]
    pub cp_engine: Option<EngineName>,
    /// Compute in f64 (the oracle) or f32 (same code, single precision); default f64, or the preset's.
    #[arg(long, value_enum)]
    pub compute: Option<Compute>,
    #[arg(long, help = precision_help())]
    pub precision: Option<String>,
    /// gpu-*: store the inputs as f32 or bf16 (default: the case's input dtype).
    #[arg(long, value_parser = gpu_dtype)]
    pub gpu_dtype: Option<Dtype>,
}

/// `--chunk-size`: one of the chunk sizes FLA's kernels use.
fn chunk_size(s: &str) -> Result<usize, String> {
    let c: usize = s
        .parse()
        .map_err(|_| format!("expected 16, 32 or 64, got `{s}`"))?;
    deltaref::registry::ChunkSize::new(c).map_err(|_| format!("expected 16, 32 or 64, got {c}"))?;
    Ok(c)
}

/// `--layout`: FLA's CP layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LayoutArg {
    Contiguous,
    Zigzag,
}

impl From<LayoutArg> for Layout {
    fn from(l: LayoutArg) -> Layout {
        match l {
            LayoutArg::Contiguous => Layout::Contiguous,
            LayoutArg::Zigzag => Layout::Zigzag,
        }
    }
}

/// `--dtype`: a dtype a case file stores ([`Dtype::CASE_FILE`]).
pub(crate) fn file_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::parse_among(s, "--dtype", &Dtype::CASE_FILE)
}

/// `--gpu-dtype`: a dtype the GPU kernels read their inputs as ([`Dtype::GPU`]).
fn gpu_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::parse_among(s, "--gpu-dtype", &Dtype::GPU)
}

impl ImplArgs {
    /// Whether any flag differs from its default (`--impl naive` alone cannot
    /// be told from no flag). Destructured, so a new flag must be counted here.
    pub fn given(&self) -> bool {
        let ImplArgs {
            imp,
            chunk_size,
            world,
            layout,
            cuts,
            cp_engine,
            compute,
            precision,
            gpu_dtype,
        } = self;
        *imp != ImplName::Naive
            || chunk_size.is_some()
            || world.is_some()
            || layout.is_some()
            || cuts.is_some()
            || cp_engine.is_some()
            || compute.is_some()
            || precision.is_some()
            || gpu_dtype.is_some()
    }

    pub fn request(&self) -> Result<(ImplRequest, Option<Compute>), CaseError> {
        let compute = self.compute;
        if compute.is_some() && self.imp.on_gpu() {
            return Err(CaseError::Usage(
                "--compute picks the oracle's scalar; the GPU kernels compute in f32 \
                 (choose their input storage with --gpu-dtype)"
                    .into(),
            ));
        }
        let req = ImplRequest {
            name: self.imp,
            gpu_dtype: self.gpu_dtype,
            chunk_size: self.chunk_size,
            world: self.world,
            layout: self.layout.map(Layout::from),
            cuts: self
                .cuts
                .as_deref()
                .map(|c| list("--cuts", c))
                .transpose()?,
            cp_engine: self.cp_engine,
            precision: self.precision.clone(),
            ..ImplRequest::default()
        };
        Ok((req, compute))
    }

    /// The implementation for `case`.
    pub fn resolve(&self, case: &Case) -> Result<(Impl, Compute), CaseError> {
        let (req, compute) = self.request()?;
        let (imp, preset_compute) = req.resolve_with_compute(case)?;
        Ok((imp, compute.or(preset_compute).unwrap_or(Compute::F64)))
    }
}
