//! `deltaref gen`: write a deterministic case file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args as ClapArgs;
use deltaref::conv::Activation;
use deltaref::cp::Layout;
use deltaref::gates::Gate;
use deltaref::inputs::Regime;
use deltaref_verify::case::{CaseError, CpLayout, Dtype, Op};
use deltaref_verify::generate::{generate_to, GenSpec};

use super::{fail, file_dtype, list, LayoutArg};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub gen: GenOpts,
    #[command(flatten)]
    pub cp: CpOpts,
    /// Where to write the case file (safetensors; written atomically).
    #[arg(long)]
    pub out: PathBuf,
    /// Write the case in this kernel convention's layout (fla, flashkda,
    /// flashinfer-gdn, flashqla, opengdn, ggml), with a `convention`
    /// metadata entry that maps it back (every deltaref command reads it
    /// in FLA's layout).
    #[arg(long, default_value = "fla")]
    pub convention: String,
}

/// How the case is cut for context parallelism: written as its `cp`
/// metadata, which `verify`, `cp` and `diagnose` use without CP flags.
#[derive(ClapArgs, Debug, Clone, Default)]
pub struct CpOpts {
    /// Record FLA's equal CP split over N ranks (T must divide).
    #[arg(long)]
    pub world: Option<usize>,
    /// With --world: contiguous (rank r holds slice r, the default) or
    /// zigzag (2W equal intervals, rank r holds r and 2W−1−r).
    #[arg(long, value_enum)]
    pub layout: Option<LayoutArg>,
    /// Record CP interior cut positions instead, e.g. 300,512,700.
    #[arg(long)]
    pub cuts: Option<String>,
}

/// The CP layout the flags ask for (`None`: no CP flag).
pub fn cp_layout(c: &CpOpts) -> Result<Option<CpLayout>, CaseError> {
    let usage = |m: &str| CaseError::Usage(m.into());
    match (c.world, c.layout, c.cuts.as_deref()) {
        (None, None, None) => Ok(None),
        (Some(_), _, Some(_)) => Err(usage("give --world or --cuts, not both")),
        (None, Some(_), _) => Err(usage("--layout applies to --world")),
        (Some(0), _, _) => Err(usage("--world: expected at least 1 rank, got 0")),
        (Some(w), l, None) => Ok(Some(CpLayout::World(
            w,
            l.map(Layout::from).unwrap_or_default(),
        ))),
        (None, None, Some(cuts)) => Ok(Some(CpLayout::Cuts(list("--cuts", cuts)?))),
    }
}

/// What to draw: the operator, shape and options (shared with `tolerance`).
#[derive(ClapArgs, Debug, Clone)]
pub struct GenOpts {
    /// kda, dplr, token_shift, gdn, gdn2 or causal_conv1d
    #[arg(long)]
    pub op: String,
    /// KDA, GDN B,T,H,HV,K,V; GDN-2, DPLR B,T,H,K,V; token-shift B,T,D; causal_conv1d B,T,D,W. With --lengths, B = 1 and T = Σ lengths (B,T may be given only if they agree).
    #[arg(long)]
    pub shape: Option<String>,
    /// Varlen sequence lengths, e.g. 37,1,64,128 (packed, B = 1).
    #[arg(long)]
    pub lengths: Option<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// KDA in-kernel gate: none, kda or lowerbound. GDN: kda sets use_gate_in_kernel (−exp(A_log)·softplus(g + dt_bias)). GDN-2: kda as GDN, lowerbound the bounded gate with safe_gate.
    #[arg(long, default_value = "none")]
    pub gate: String,
    /// Lower bound of the lowerbound gate (default -5, FLA's recommended value; FLA accepts [-5, 0)).
    #[arg(long, allow_negative_numbers = true)]
    pub lower_bound: Option<f64>,
    /// KDA use_qk_l2norm_in_kernel (without it, keys are drawn unit-norm, as in FLA's tests).
    #[arg(long)]
    pub l2norm: bool,
    /// KDA use_beta_sigmoid_in_kernel.
    #[arg(long)]
    pub beta_sigmoid: bool,
    /// KDA allow_neg_eigval (with --beta-sigmoid).
    #[arg(long)]
    pub allow_neg_eigval: bool,
    /// Store an initial state (token-shift: a cache).
    #[arg(long)]
    pub initial_state: bool,
    /// GDN, GDN-2 state_v_first: states stored as [N,HV,V,K].
    #[arg(long)]
    pub state_v_first: bool,
    /// causal_conv1d activation: none, silu (or swish).
    #[arg(long, default_value = "none")]
    pub activation: String,
    /// causal_conv1d: store a bias [D].
    #[arg(long)]
    pub bias: bool,
    /// Attention scale (default K^-0.5).
    #[arg(long)]
    pub scale: Option<f64>,
    /// Storage dtype of the inputs and upstream gradients: f64, f32, bf16, f16.
    #[arg(long, default_value = "f64", value_parser = file_dtype)]
    pub dtype: Dtype,
    /// Also store the float64 outputs and gradients.
    #[arg(long)]
    pub expected: bool,
    /// Input distribution: fla-test (FLA's test draws), long-memory (decay ≈ 1, small β:
    /// M and the carried CP state stay O(1)), mixed (per-channel fast/slow decay),
    /// sharp (gates at the lower bound, β ≈ 1). Token-shift: changes x (slow, mixed scales, heavy tails).
    #[arg(long, default_value = "fla-test")]
    pub regime: String,
}

/// The generation spec the options describe.
pub fn spec(a: &GenOpts) -> Result<GenSpec, CaseError> {
    let usage = |m: String| CaseError::Usage(m);
    let op = Op::parse(&a.op).ok_or_else(|| {
        usage(format!(
            "--op: unknown op `{}` ({})",
            a.op,
            Op::names_list()
        ))
    })?;
    let dplr_bound = op == Op::Dplr && a.gate == "none" && a.lower_bound.is_some();
    let gate = match a.gate.as_str() {
        // DPLR has no in-kernel gate: its `--lower-bound` is FLA's
        // `lower_bound` on gk (drawn in [X, 0)).
        "none" if dplr_bound => Gate::LowerBound {
            lower_bound: a.lower_bound.unwrap_or_default(),
        },
        "lowerbound" => Gate::LowerBound {
            lower_bound: a.lower_bound.unwrap_or(-5.0),
        },
        "none" => Gate::None,
        "kda" => Gate::Kda,
        g => {
            return Err(usage(format!(
                "--gate: unknown gate `{g}` (none, kda, lowerbound)"
            )))
        }
    };
    if let Some(lb) = a
        .lower_bound
        .filter(|lb| op == Op::Dplr && !(lb.is_finite() && *lb < 0.0))
    {
        return Err(usage(format!(
            "--lower-bound: dplr's gk is a log-decay, so its bound is negative, got {lb}"
        )));
    }
    if let Some(lb) = a
        .lower_bound
        .filter(|lb| op != Op::Dplr && !(-5.0..0.0).contains(lb))
    {
        return Err(usage(format!(
            "--lower-bound: FLA's safe gate accepts [-5, 0), got {lb}"
        )));
    }
    if a.lower_bound.is_some() && !matches!(gate, Gate::LowerBound { .. }) {
        return Err(usage("--lower-bound needs --gate lowerbound".into()));
    }
    let activation =
        Activation::parse(&a.activation).map_err(|e| usage(format!("--activation: {e}")))?;
    Ok(GenSpec {
        shape: a.shape.as_deref().map(|s| list("--shape", s)).transpose()?,
        lengths: a
            .lengths
            .as_deref()
            .map(|s| list("--lengths", s))
            .transpose()?,
        seed: a.seed,
        gate,
        use_qk_l2norm_in_kernel: a.l2norm,
        use_beta_sigmoid_in_kernel: a.beta_sigmoid,
        allow_neg_eigval: a.allow_neg_eigval,
        initial_state: a.initial_state,
        state_v_first: a.state_v_first,
        activation,
        bias: a.bias,
        scale: a.scale,
        dtype: a.dtype,
        expected: a.expected,
        regime: Regime::parse(&a.regime).ok_or_else(|| {
            usage(format!(
                "--regime: unknown regime `{}` (fla-test, long-memory, mixed, sharp)",
                a.regime
            ))
        })?,
        ..GenSpec::new(op)
    })
}

/// `gen --convention X`: the case drawn in FLA's convention, written in
/// X's layout (inputs rounded there; the truth of what is stored); returns
/// the number of tensors written.
fn generate_in_convention(
    s: &GenSpec,
    name: &str,
    out: &std::path::Path,
) -> Result<usize, CaseError> {
    let conv = deltaref_verify::convention::find(name).ok_or_else(|| {
        CaseError::Usage(format!(
            "--convention: unknown `{name}` (available: {})",
            deltaref_verify::convention::names()
        ))
    })?;
    let case = deltaref_verify::generate::generate(&GenSpec {
        expected: false,
        ..s.clone()
    })?;
    let (kernel, bytes) = conv.write_case(&case, s.dtype, s.expected)?;
    deltaref_verify::case::write_atomic(out, &bytes)?;
    Ok(kernel.tensors.len() + usize::from(kernel.cu_seqlens.is_some()))
}

/// [`spec`] with the case's CP layout, checked against its tokens.
fn with_cp(a: &Args) -> Result<GenSpec, CaseError> {
    let s = GenSpec {
        cp: cp_layout(&a.cp)?,
        ..spec(&a.gen)?
    };
    s.check_cp()?;
    Ok(s)
}

pub fn run(a: Args) -> ExitCode {
    let result = with_cp(&a).and_then(|s| {
        // Refuse an unwritable destination before the work, not after it.
        deltaref_verify::files::destination(&a.out)?;
        if a.convention == "fla" {
            generate_to(&s, &a.out)
        } else {
            generate_in_convention(&s, &a.convention, &a.out)
        }
    });
    match result {
        Ok(count) => {
            super::print(&format!("wrote {} ({count} tensors)", a.out.display()));
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}
