//! `deltaref cp`: run a case under simulated context parallel and print the
//! per-rank table (local `cu_seqlens`, `pre/post_num_ranks`, `S_ext`, `M`,
//! merged states against the non-CP state at the same token) and the CP vs
//! non-CP comparison of every tensor.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args as ClapArgs;
use deltaref::cp::Carry;
use deltaref::cp::{self, IntraParams};
use deltaref::cp::{table, RankDiag};
use deltaref_verify::case::{Case, CaseError};
use deltaref_verify::heads::{BlockRows, HeadFile, STREAM_MIN_BYTES};
use deltaref_verify::impls::{oracle_truth_owned, Compute, Impl, ImplName, DEFAULT_CHUNK_SIZE};
use deltaref_verify::progress::Progress;
use deltaref_verify::report::VerifyReport;
use ndarray::Array2;

use super::{fail, Against, ImplArgs};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[arg(long, help = super::CASE_HELP)]
    pub case: PathBuf,
    #[command(flatten)]
    pub imp: ImplArgs,
    /// Intra-card CP: split long sequences with FLA's rule instead of --world/--cuts.
    #[arg(long)]
    pub intra: bool,
    /// Intra-card: explicit sub-sequence length (else FLA's compute_subseq_len).
    #[arg(long)]
    pub subseq_len: Option<usize>,
    /// Intra-card: streaming multiprocessors of the device (H100: 132).
    #[arg(long, default_value_t = 132)]
    pub num_sms: usize,
    /// Intra-card: heads (FLA passes the value-head count; default: the case's HV).
    #[arg(long)]
    pub num_heads: Option<usize>,
    /// Intra-card: most pieces per sequence.
    #[arg(long, default_value_t = 32)]
    pub max_splits: usize,
    /// CP vs non-CP tolerance (exact arithmetic: rounding only).
    #[arg(long, default_value_t = 1e-10)]
    pub max_ratio: f64,
    /// What the CP run's tensors are compared with: `truth` (the f64
    /// non-CP oracle) or `non-cp` (the same engine, precision and compute
    /// without CP, as FLA's CP tests do: only the CP path's error remains).
    #[arg(long, value_enum, default_value_t = Against::Truth)]
    pub against: Against,
}

/// `deltaref cp` on the whole case: the per-rank table and the report as
/// printed, and whether every tensor passes.
pub fn go(a: &Args) -> Result<(String, bool), CaseError> {
    super::check_ratio("--max-ratio", a.max_ratio)?;
    if !matches!(a.imp.imp, ImplName::Naive | ImplName::Cp) {
        return Err(CaseError::Usage(format!(
            "--impl {}: `deltaref cp` always runs --impl cp, context parallel simulated in \
             the oracle's code (leave --impl out: its default, naive, means cp here); for \
             the GPU kernels run `verify --impl gpu-cp`",
            a.imp.imp
        )));
    }
    if !a.intra && (a.subseq_len.is_some() || a.num_heads.is_some()) {
        return Err(CaseError::Usage(
            "--subseq-len and --num-heads apply to --intra".into(),
        ));
    }
    if a.intra && (a.num_sms == 0 || a.max_splits == 0 || a.num_heads == Some(0)) {
        return Err(CaseError::Usage(
            "--intra: --num-sms, --num-heads and --max-splits must be ≥ 1".into(),
        ));
    }
    if let Some(file) = HeadFile::open(&a.case, STREAM_MIN_BYTES)? {
        return streamed(a, &file);
    }
    let case = Case::read(&a.case)?;
    super::warn_domain(&case);
    let hv = value_heads(&case);
    let run = run_block(a, case, hv, None)?;
    let report = VerifyReport::new(
        &a.case.display().to_string(),
        &run.reference_label,
        &run.label,
        &run.reference,
        &run.got,
        a.max_ratio,
    );
    Ok(print(&run.name, run.carry, &run.diags, report))
}

/// What the report names the non-CP reference.
const REFERENCE: &str = "impl:naive (non-CP, f64)";

/// The non-CP reference and the CP run of a case (a whole case, or a head
/// block of one), with the per-rank diagnostics of an f64 run.
struct Run {
    /// The implementation's name.
    name: String,
    /// `impl:… [precision P, compute C]`.
    label: String,
    /// What `reference` is (the f64 oracle, or the same run without CP).
    reference_label: String,
    reference: deltaref_verify::outputs::Tensors,
    got: deltaref_verify::outputs::Tensors,
    diags: Vec<RankDiag<f64>>,
    /// What the op hands across a cut (picks the table's columns).
    carry: Carry,
}

/// Runs `case` under CP as the flags ask, then the non-CP reference on
/// it, so that the reference's results are not held during the CP run;
/// `hv`: the whole case's value heads (`--intra`'s default `--num-heads`).
/// With `again` (the case read anew), each run consumes its own copy of
/// the inputs; without, the CP run copies them and the reference consumes
/// `case`.
fn run_block(
    a: &Args,
    case: Case,
    hv: usize,
    again: Option<&dyn Fn() -> Result<Case, CaseError>>,
) -> Result<Run, CaseError> {
    let (mut req, explicit_compute) = a.imp.request()?;
    req.name = ImplName::Cp;
    if a.intra {
        if req.world.is_some() || req.cuts.is_some() {
            return Err(CaseError::Usage(
                "--intra chooses the cuts itself: drop --world/--cuts".into(),
            ));
        }
        let cu = case
            .cu_seqlens
            .clone()
            .unwrap_or_else(|| vec![0, seq_len(&case) as i64]);
        let params = IntraParams {
            num_sms: a.num_sms,
            num_heads: a.num_heads.unwrap_or(hv),
            chunk_size: req.chunk_size.unwrap_or(DEFAULT_CHUNK_SIZE),
            max_splits: a.max_splits,
            subseq_len: a.subseq_len,
        };
        let cuts = cp::split_points(&cu, &params).map_err(|e| CaseError::Usage(e.to_string()))?;
        req.cuts = Some(cuts);
    }
    let (imp, preset_compute) = req.resolve_with_compute(&case)?;
    let compute = explicit_compute.or(preset_compute).unwrap_or(Compute::F64);
    imp.check_memory(&case)?;
    Impl::NAIVE.check_memory(&case)?;
    let invalid = CaseError::computing(&a.case);
    let progress = Progress::spinner(&format!("computing impl:{}", imp.name()));
    // The per-rank table in every precision: the run's merged states
    // against the same engine's non-CP states at the same precision.
    let (got, diags, case) = match again {
        None => {
            let (got, diags) = imp
                .compute_with_diags_in(std::borrow::Cow::Borrowed(&case), compute)
                .map_err(|e| invalid(e.into()))?;
            (got, diags, case)
        }
        Some(again) => {
            let (got, diags) = imp
                .compute_with_diags_in(std::borrow::Cow::Owned(case), compute)
                .map_err(|e| invalid(e.into()))?;
            (got, diags, again()?)
        }
    };
    drop(progress);
    let carry = case.meta.op.info().carry;
    let precision = a.imp.precision.as_deref();
    let (reference, reference_label) = match a.against {
        Against::Truth => (oracle_truth_owned(case, &a.case)?, REFERENCE.to_string()),
        Against::NonCp => super::non_cp_reference(&imp, &case, precision, compute, false)?,
    };
    let label = super::impl_label(&imp.name(), a.imp.precision.as_deref(), compute);
    Ok(Run {
        name: imp.name(),
        label,
        reference_label,
        reference,
        got,
        diags,
        carry,
    })
}

/// `deltaref cp` of a large case one head block at a time (see
/// [`HeadFile`]): each block's inputs read from the file, its reference
/// and CP runs compared tensor by tensor ([`BlockRows`]) and its per-head
/// states appended to the ranks' diagnostics, in head order: the table is
/// the whole case's, the report's rows too (`norm_ratio` to rounding).
pub fn streamed(a: &Args, file: &HeadFile) -> Result<(String, bool), CaseError> {
    let blocks = file.blocks();
    let bar = Progress::bar(blocks.len() as u64, "head blocks");
    let mut rows = BlockRows::default();
    let mut diags: Vec<RankDiag<f64>> = vec![];
    let (mut name, mut label, mut reference_label) = (String::new(), String::new(), String::new());
    let mut carry = Carry::State;
    for heads in &blocks {
        bar.step(&format!(
            "heads {}..{} of {}",
            heads.start,
            heads.end,
            file.heads()
        ));
        let case = file.read_inputs(heads)?;
        let hv = value_heads(&case) / heads.len() * file.heads();
        let mut run = run_block(a, case, hv, Some(&|| file.read_inputs(heads)))?;
        for (name, truth) in std::mem::take(&mut run.reference) {
            rows.add(file, heads, &name, &truth, run.got.remove(&name).as_ref())?;
        }
        append_heads(&mut diags, run.diags);
        (name, label, reference_label, carry) =
            (run.name, run.label, run.reference_label, run.carry);
        bar.inc();
    }
    drop(bar);
    let report = VerifyReport::from_rows(
        &a.case.display().to_string(),
        &reference_label,
        &label,
        rows.rows(a.max_ratio),
        a.max_ratio,
    );
    Ok(print(&name, carry, &diags, report))
}

/// Appends a head block's per-head states to the ranks' diagnostics (the
/// first block's are taken as they are).
fn append_heads(diags: &mut Vec<RankDiag<f64>>, block: Vec<RankDiag<f64>>) {
    if diags.is_empty() {
        *diags = block;
        return;
    }
    fn extend(a: &mut Option<Vec<Array2<f64>>>, b: Option<Vec<Array2<f64>>>) {
        if let (Some(a), Some(b)) = (a, b) {
            a.extend(b);
        }
    }
    for (d, b) in diags.iter_mut().zip(block) {
        d.s_ext.extend(b.s_ext);
        d.m.extend(b.m);
        extend(&mut d.merged_h0, b.merged_h0);
        extend(&mut d.reference_h0, b.reference_h0);
        extend(&mut d.ds_ext, b.ds_ext);
        extend(&mut d.m_first, b.m_first);
        extend(&mut d.merged_dht, b.merged_dht);
        extend(&mut d.reference_dht, b.reference_dht);
    }
}

/// The per-rank table (f64 runs) of impl `name`, in the columns of what
/// the op carries across a cut, and the report, and whether it passes.
fn print(
    name: &str,
    carry: Carry,
    diags: &[RankDiag<f64>],
    report: VerifyReport,
) -> (String, bool) {
    let mut out = String::new();
    if !diags.is_empty() {
        out += &format!("per-rank table ({name}; norms over all heads; `vs nonCP` = max |merged − non-CP state| of the same engine and precision):\n");
        out += &table(diags, carry);
        out += &match carry {
            Carry::State => memory_line(diags),
            Carry::Tokens => "carried state: the cache (the previous rank's last tokens), \
                              replaced at each cut, not transformed: no M\n"
                .into(),
        };
        out += "\n";
    }
    out += &report.to_string();
    (out, report.pass)
}

/// Whether the case exercises the merge: the largest `max |M|` over the
/// ranks whose `(S_ext, M)` some later rank merges. `M` near 0 means the
/// carried state is forgotten within a rank, so merge faults barely show.
fn memory_line(diags: &[RankDiag<f64>]) -> String {
    let max_abs = |m: &[Array2<f64>]| {
        m.iter()
            .flat_map(|a| a.iter())
            .fold(0.0f64, |x, v| x.max(v.abs()))
    };
    let layout = deltaref::cp::layout_of(diags);
    let merged: Vec<(String, f64)> = diags
        .iter()
        .filter(|d| d.meta.post_num_ranks > 0)
        .map(|d| (d.meta.label(layout), max_abs(&d.m)))
        .collect();
    match merged.into_iter().max_by(|a, b| a.1.total_cmp(&b.1)) {
        None => "no rank hands a state on: the merge is not exercised\n".into(),
        Some((r, m)) => format!(
            "max |M| entry over merged ranks: {m:.3e} (rank {r}); {}\n",
            if m < 1e-3 {
                "the carried state is forgotten within a rank: merge faults barely show (try gen --regime long-memory)"
            } else {
                "the carried state survives across ranks: the merge is exercised"
            }
        ),
    }
}

/// HV of a case (`v [B,T,HV,V]`; 1 for token-shift), FLA's `num_heads`.
fn value_heads(case: &Case) -> usize {
    case.tensors
        .get("v")
        .and_then(|v| v.shape().get(2).copied())
        .unwrap_or(1)
}

/// T of a case's inputs (read off its first input, `q` or `x`).
fn seq_len(case: &Case) -> usize {
    case.tensors
        .get(case.meta.op.first_input())
        .and_then(|x| x.shape().get(1).copied())
        .unwrap_or(0)
}

pub fn run(a: Args) -> ExitCode {
    match go(&a) {
        Ok((s, pass)) => {
            super::print(&s);
            if pass {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => fail(&e),
    }
}
