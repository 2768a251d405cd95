//! `deltaref gen`: deterministic cases with FLA-test-like inputs.

use std::path::Path;

use deltaref::conv::Activation;
use deltaref::cp::PlanSpec;
use deltaref::gates::Gate;
use deltaref::inputs::{Draw, Layout, Regime};
use deltaref::registry::{DrawRequest, GenFlags, Options};

use crate::case::{
    result_shape_of, results_of, Case, CaseError, CaseMeta, CpLayout, Drawn, Dtype, Op,
};
use crate::heads::HeadFile;
use crate::impls::{first_non_finite, Compute, Impl};
use crate::memory::{self, Problem, Run};
use crate::outputs::Tensors;
use crate::progress::Progress;

/// What to generate (the `gen` flags).
#[derive(Clone, Debug, PartialEq)]
pub struct GenSpec {
    pub op: Op,
    /// KDA, GDN `B,T,H,HV,K,V`; DPLR `B,T,H,K,V`; token-shift `B,T,D`;
    /// causal conv1d `B,T,D,W`.
    pub shape: Option<Vec<usize>>,
    /// Varlen sequence lengths: then B = 1 and T = Σ lengths.
    pub lengths: Option<Vec<usize>>,
    pub seed: u64,
    pub gate: Gate,
    pub use_qk_l2norm_in_kernel: bool,
    pub use_beta_sigmoid_in_kernel: bool,
    pub allow_neg_eigval: bool,
    pub initial_state: bool,
    /// GDN: states in `[N, HV, V, K]`.
    pub state_v_first: bool,
    /// Causal conv1d.
    pub activation: Activation,
    /// Causal conv1d: store a bias.
    pub bias: bool,
    pub scale: Option<f64>,
    pub dtype: Dtype,
    /// Store the float64 outputs and gradients too.
    pub expected: bool,
    /// How the inputs are distributed (see [`Regime`]).
    pub regime: Regime,
    /// KDA without `use_qk_l2norm_in_kernel`: draw unit-norm keys, as FLA's
    /// tests do (`F.normalize(randn)`); raw normal keys give `‖k‖² ≈ K`, so
    /// `I − β k kᵀ` has an eigenvalue near `1 − βK` and the state explodes.
    pub unit_norm_keys: bool,
    /// The case's CP layout (its `cp` metadata), which `verify`, `cp` and
    /// `diagnose` use when no CP flag is given.
    pub cp: Option<CpLayout>,
}

impl GenSpec {
    pub fn new(op: Op) -> Self {
        GenSpec {
            op,
            shape: None,
            lengths: None,
            seed: 0,
            gate: Gate::None,
            use_qk_l2norm_in_kernel: false,
            use_beta_sigmoid_in_kernel: false,
            allow_neg_eigval: false,
            initial_state: false,
            state_v_first: false,
            activation: Activation::None,
            bias: false,
            scale: None,
            dtype: Dtype::F64,
            expected: false,
            regime: Regime::FlaTest,
            unit_norm_keys: true,
            cp: None,
        }
    }

    /// What the flags ask of the op, in the registry's words.
    pub fn flags(&self) -> GenFlags {
        GenFlags {
            gate: self.gate,
            l2norm: self.use_qk_l2norm_in_kernel,
            beta_sigmoid: self.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: self.allow_neg_eigval,
            initial_state: self.initial_state,
            state_v_first: self.state_v_first,
            activation: self.activation,
            bias: self.bias,
            scale: self.scale,
        }
    }

    /// The op's options the flags ask for (flags the op does not take
    /// are refused, naming the ops that do).
    pub fn options(&self) -> Result<Options, CaseError> {
        self.op
            .entry()
            .gen_options(&self.flags())
            .map_err(CaseError::Usage)
    }

    /// The shape with defaults filled in and checked against `lengths`.
    fn dims(&self) -> Result<(Layout, Vec<usize>), CaseError> {
        let info = self.op.info();
        let (default, names) = (info.default_shape, info.shape);
        let shape = self.shape.clone().unwrap_or_else(|| default.to_vec());
        if shape.len() != default.len() {
            return Err(CaseError::Usage(format!(
                "--shape for {} is {names}, got {} numbers",
                self.op.name(),
                shape.len()
            )));
        }
        if shape[2..].contains(&0) {
            return Err(CaseError::Usage(format!(
                "--shape {names}: head and feature sizes must be ≥ 1, got {shape:?}"
            )));
        }
        let layout = match &self.lengths {
            None => Layout::batch(shape[0], shape[1]),
            Some(l) => {
                let t = l
                    .iter()
                    .try_fold(0usize, |a, &x| a.checked_add(x))
                    .filter(|&t| i64::try_from(t).is_ok())
                    .ok_or_else(|| {
                        CaseError::Usage(format!(
                            "--lengths: the total Σ lengths overflows the int64 range of cu_seqlens (got {l:?})"
                        ))
                    })?;
                if self.shape.is_some() && (shape[0] != 1 || shape[1] != t) {
                    return Err(CaseError::Usage(format!(
                        "with --lengths the batch is packed: --shape must have B = 1 and T = Σ lengths = {t}, got B = {}, T = {}",
                        shape[0], shape[1]
                    )));
                }
                Layout::varlen(l)
            }
        };
        if i64::try_from(layout.t).is_err() || memory::elements(&shape).is_none() {
            return Err(CaseError::Usage(format!(
                "--shape {names}: {shape:?} overflows a 64-bit element count"
            )));
        }
        if !info.regimes.contains(&self.regime) {
            return Err(CaseError::Usage(format!(
                "--regime: {} draws {} only",
                self.op.name(),
                info.regimes
                    .iter()
                    .map(|r| r.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok((layout, shape[2..].to_vec()))
    }

    /// The memory-relevant sizes of the problem: the op's shape names
    /// `H`, `HV`, `K` (`W`), `V` (`D`) read off `dims`.
    fn problem(&self, layout: &Layout, dims: &[usize]) -> Result<Problem, CaseError> {
        let names: Vec<&str> = self.op.info().shape.split(',').skip(2).collect();
        let dim = |n: &str| names.iter().position(|x| *x == n).map(|i| dims[i]);
        let h = dim("H").unwrap_or(1);
        Ok(Problem::new(
            self.op,
            &self.options()?,
            [layout.b, layout.t, layout.n()],
            [
                h,
                dim("HV").unwrap_or(h),
                dim("K").or(dim("W")).unwrap_or(1),
                dim("V").or(dim("D")).unwrap_or(1),
            ],
        ))
    }

    /// The case's metadata (its options refused as [`GenSpec::options`] does).
    pub fn meta(&self) -> Result<CaseMeta, CaseError> {
        Ok(CaseMeta {
            options: self.options()?,
            seed: Some(self.seed),
            dtype: Some(self.dtype),
            // FLA's draws stay unrecorded, so cases generated before regimes existed keep their bytes.
            regime: (self.regime != Regime::FlaTest).then_some(self.regime),
            cp: self.cp.clone(),
            ..CaseMeta::new(self.op)
        })
    }

    /// The op's draws of every input and upstream gradient.
    fn draws(&self, layout: Layout, dims: &[usize]) -> Result<Vec<Draw>, CaseError> {
        let flags = self.flags();
        let r = DrawRequest {
            layout,
            dims,
            flags: &flags,
            regime: self.regime,
            seed: self.seed,
            unit_norm_keys: self.unit_norm_keys,
        };
        Ok(self.op.entry().draws(&r, &self.options()?))
    }
}

/// Generates a case; with `expected`, the f64 truth is computed from the
/// stored (possibly rounded) inputs.
pub fn generate(spec: &GenSpec) -> Result<Case, CaseError> {
    let (layout, dims) = spec.dims()?;
    let problem = spec.problem(&layout, &dims)?;
    let need = if spec.expected {
        problem.gen_bytes()
    } else {
        problem.draw_bytes()
    };
    memory::check("generating this case", need)?;
    let progress = Progress::spinner("drawing the inputs");
    let mut case = draw(spec, layout, &dims)?;
    case.validate()
        .map_err(|e| CaseError::Usage(e.to_string()))?;
    if spec.expected {
        progress.step("computing the f64 truth");
        // A long case's truth is computed a few heads at a time (same
        // values; one per thread keeps every core busy): only those heads'
        // engine buffers are live, not every head's.
        let naive = |c: Case| Impl::NAIVE.compute_owned(c, Compute::F64);
        let truth = (problem.compute_bytes(Run::Naive) > crate::heads::STREAM_MIN_BYTES)
            .then(|| crate::heads::compute_by_blocks(&case, rayon::current_num_threads(), naive))
            .flatten()
            .unwrap_or_else(|| Impl::NAIVE.compute(&case, Compute::F64))
            .map_err(|e| CaseError::Usage(e.to_string()))?;
        if let Some((n, i, v)) = first_non_finite(&truth) {
            return Err(non_finite(&n, v, i, truth[&n].shape()));
        }
        for (n, t) in truth {
            case.insert(&n, t, Dtype::F64);
        }
    }
    Ok(case)
}

/// Generates the case `spec` describes and writes it to `path` (atomically,
/// the bytes of [`generate`]'s case written by [`Case::write`]); returns the
/// number of tensors written. A long KDA or DPLR case never holds its
/// truth whole: see [`generate_streamed`].
pub fn generate_to(spec: &GenSpec, path: &Path) -> Result<usize, CaseError> {
    let (layout, dims) = spec.dims()?;
    let problem = spec.problem(&layout, &dims)?;
    if spec.op.info().streams_by_head
        && problem.compute_bytes(Run::Naive) > crate::heads::STREAM_MIN_BYTES
    {
        return generate_streamed(spec, path, rayon::current_num_threads());
    }
    let case = generate(spec)?;
    case.write(path)?;
    Ok(case.tensors.len() + usize::from(case.cu_seqlens.is_some()))
}

/// [`generate_to`] in bounded memory, `per_block` query/key heads at a
/// time (heads never mix, see [`crate::heads`]; KDA and DPLR only). The
/// inputs are drawn one tensor at a time (each tensor is its own random
/// stream, [`inputs::Draw`]), written to the file in the storage dtype and
/// freed before the next is drawn; then each head block
/// of the inputs is read back from the file, validated as a case, and its
/// f64 truth computed and written into its slices of the result tensors.
/// The file is byte for byte [`generate_to`]'s.
pub fn generate_streamed(
    spec: &GenSpec,
    path: &Path,
    per_block: usize,
) -> Result<usize, CaseError> {
    let (layout, dims) = spec.dims()?;
    let problem = spec.problem(&layout, &dims)?;
    let drawn = head_draws(spec)?;
    let per_block = fill_heads(per_block, spec.expected).clamp(1, problem.h);
    // The blocks `fill` reads are at most `per_block` heads and at most
    // verify's (`heads::heads_per_block` of the file's data: the inputs
    // stored, room for as many f64 results).
    let width = crate::case::stored_width(spec.dtype);
    let inputs = problem.input_elements();
    let data = inputs
        .saturating_mul(width as u64)
        .saturating_add(if spec.expected {
            inputs.saturating_mul(8)
        } else {
            0
        });
    let heads = per_block.min(crate::heads::heads_per_block(data, problem.h));
    let need = problem.gen_streamed_bytes(heads, spec.expected, width);
    memory::check("generating this case", need)?;
    let results = if spec.expected {
        planned_results(spec.op, |n| {
            let d = drawn.iter().find(|d| d.draw.name == n)?;
            Some(d.draw.shape.clone())
        })?
    } else {
        vec![]
    };
    let mut case = Case::new(spec.meta()?);
    case.cu_seqlens = layout.cu_seqlens();
    let progress = Progress::spinner("drawing and writing the inputs");
    case.write_filled(path, drawn, &results, |tmp| {
        drop(progress);
        fill(tmp, per_block, &results)
    })
}

/// How many query/key heads [`generate_streamed`], asked for `per_block`,
/// reads back at a time: `per_block` when it computes the truth
/// (`expected`), which runs a block's heads in parallel; else one, since
/// a block that is only read back and validated runs on one thread, and
/// one head holds the least.
pub fn fill_heads(per_block: usize, expected: bool) -> usize {
    if expected {
        per_block
    } else {
        1
    }
}

/// The tensors of a case of an op that streams by head (KDA, DPLR), one
/// draw each, stored in the spec's dtype: drawn and rounded, they are
/// [`generate`]'s inputs. Other ops are refused.
pub fn head_draws(spec: &GenSpec) -> Result<Vec<Drawn>, CaseError> {
    let (layout, dims) = spec.dims()?;
    if !spec.op.info().streams_by_head {
        return Err(CaseError::Usage(format!(
            "generating head block by head block applies to ops whose every tensor has a head axis, not {}",
            spec.op.name()
        )));
    }
    Ok(spec
        .draws(layout, &dims)?
        .into_iter()
        .map(|draw| Drawn {
            draw,
            dtype: spec.dtype,
        })
        .collect())
}

/// The results the oracle computes for a case of `op` whose tensors have
/// the shapes `shape(name)` gives, with their shapes.
fn planned_results(
    op: Op,
    shape: impl Fn(&str) -> Option<Vec<usize>>,
) -> Result<Vec<(String, Vec<usize>)>, CaseError> {
    results_of(op, &shape)
        .into_iter()
        .map(|n| {
            let s = result_shape_of(op, n, &shape).ok_or_else(|| {
                CaseError::Usage(format!("the case has no input to shape result `{n}` by"))
            })?;
            Ok((n.to_string(), s))
        })
        .collect()
}

/// Validates the inputs of the case file `tmp` head block by head block
/// and writes each block's f64 truth (`results`, none: validation only).
fn fill(tmp: &Path, per_block: usize, results: &[(String, Vec<usize>)]) -> Result<(), CaseError> {
    let file = HeadFile::for_filling(tmp, per_block)?.ok_or_else(|| {
        CaseError::Usage(format!(
            "{}: the case does not split by heads",
            tmp.display()
        ))
    })?;
    let blocks = file.blocks();
    let bar = Progress::bar(blocks.len() as u64, "head blocks");
    for heads in &blocks {
        let of = format!("heads {}..{} of {}", heads.start, heads.end, file.heads());
        bar.step(&format!("{of}: reading and validating the inputs"));
        let block = file.read_inputs(heads)?;
        if !results.is_empty() {
            bar.step(&format!("{of}: computing the f64 truth"));
            let truth = Impl::NAIVE
                .compute_owned(block, Compute::F64)
                .map_err(|e| CaseError::Usage(e.to_string()))?;
            same_names(results, &truth)?;
            if let Some((n, i, v)) = first_non_finite(&truth) {
                let (shape, at) = file
                    .place(&n, truth[&n].shape(), heads)
                    .ok_or_else(|| CaseError::Usage(format!("result `{n}` has no head axis")))?;
                return Err(non_finite(&n, v, at(i), &shape));
            }
            bar.step(&format!("{of}: writing the f64 truth"));
            for (n, x) in truth {
                file.write_result(heads, &n, &x)?;
            }
        }
        bar.inc();
    }
    Ok(())
}

/// The oracle's results must be the planned ones: a result the file has no
/// room for, or room left unwritten, would be a wrong file.
fn same_names(planned: &[(String, Vec<usize>)], got: &Tensors) -> Result<(), CaseError> {
    let want: Vec<&str> = planned.iter().map(|(n, _)| n.as_str()).collect();
    let mut have: Vec<&str> = got.keys().map(String::as_str).collect();
    let mut sorted = want.clone();
    sorted.sort_unstable();
    have.sort_unstable();
    if sorted != have {
        return Err(CaseError::Usage(format!(
            "the f64 oracle computed {have:?}, the case file was planned for {want:?}"
        )));
    }
    Ok(())
}

/// The refusal of a truth whose `name` is `v` (non-finite) at flat index
/// `i` of `shape`.
fn non_finite(name: &str, v: f64, i: usize, shape: &[usize]) -> CaseError {
    CaseError::Usage(format!(
        "the f64 oracle's `{name}` is non-finite ({v} at flat index {i} of shape {shape:?}): \
         the inputs overflow the recurrence (unstable keys, gates or scale); \
         refusing to store a non-finite truth"
    ))
}

/// The case's drawn inputs and upstream gradients, rounded to the storage
/// dtype (not yet validated).
fn draw(spec: &GenSpec, layout: Layout, dims: &[usize]) -> Result<Case, CaseError> {
    let mut case = Case::new(spec.meta()?);
    case.cu_seqlens = layout.cu_seqlens();
    for d in spec.draws(layout, dims)? {
        case.insert(d.name, d.draw(), spec.dtype);
    }
    Ok(case)
}

impl GenSpec {
    /// Refuses a CP layout ([`GenSpec::cp`]) that cannot cut the case's
    /// tokens (a world that does not divide `T`, cuts out of order or past
    /// `T`, `B > 1`), before anything is drawn.
    pub fn check_cp(&self) -> Result<(), CaseError> {
        let Some(cp) = &self.cp else {
            return Ok(());
        };
        let (layout, _) = self.dims()?;
        let (b, t) = (layout.b, layout.t);
        let cu: Option<Vec<i64>> = self.lengths.as_ref().map(|l| {
            std::iter::once(0)
                .chain(l.iter().scan(0i64, |acc, &n| {
                    *acc += n as i64;
                    Some(*acc)
                }))
                .collect()
        });
        let plan = match cp {
            CpLayout::World(w, deltaref::cp::Layout::Contiguous) => PlanSpec::World(*w),
            CpLayout::World(w, deltaref::cp::Layout::Zigzag) => PlanSpec::Zigzag(*w),
            CpLayout::Cuts(c) => PlanSpec::Cuts(c.clone()),
        };
        plan.build(b, t, cu.as_deref())
            .map(|_| ())
            .map_err(|e| CaseError::Usage(format!("--world/--cuts: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole_bytes(spec: &GenSpec, dir: &Path) -> Vec<u8> {
        let path = dir.join("whole.safetensors");
        generate(spec).unwrap().write(&path).unwrap();
        std::fs::read(path).unwrap()
    }

    /// GVA, a gate with `A_log` and `dt_bias`, initial states, three
    /// sequences: every head axis of KDA occurs.
    fn kda_spec(dtype: Dtype) -> GenSpec {
        let mut spec = GenSpec::new(Op::Kda);
        spec.lengths = Some(vec![5, 40, 19]);
        spec.shape = Some(vec![1, 64, 3, 6, 8, 4]);
        spec.gate = Gate::LowerBound { lower_bound: -5.0 };
        spec.use_qk_l2norm_in_kernel = true;
        spec.initial_state = true;
        spec.expected = true;
        spec.dtype = dtype;
        spec
    }

    /// The streamed file is the whole-case file, byte for byte, whatever
    /// the blocks (one head, two of three, every head).
    #[test]
    fn streamed_files_are_the_whole_cases_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let mut dplr = GenSpec::new(Op::Dplr);
        dplr.shape = Some(vec![2, 24, 2, 8, 4]);
        dplr.initial_state = true;
        dplr.expected = true;
        let mut plain = kda_spec(Dtype::F64);
        plain.gate = Gate::None;
        plain.use_qk_l2norm_in_kernel = false;
        plain.initial_state = false;
        let mut inputs_only = kda_spec(Dtype::F32);
        inputs_only.expected = false;
        let mut single = kda_spec(Dtype::Bf16);
        single.shape = Some(vec![1, 64, 1, 2, 8, 4]);
        let mut single_dplr = dplr.clone();
        single_dplr.shape = Some(vec![2, 24, 1, 8, 4]);
        for spec in [
            kda_spec(Dtype::Bf16),
            kda_spec(Dtype::F64),
            plain,
            dplr,
            inputs_only,
            single,
            single_dplr,
        ] {
            let whole = whole_bytes(&spec, dir.path());
            for per_block in [1, 2, 3] {
                let path = dir.path().join("streamed.safetensors");
                let count = generate_streamed(&spec, &path, per_block).unwrap();
                let case = Case::read(&path).unwrap();
                assert_eq!(
                    count,
                    case.tensors.len() + usize::from(case.cu_seqlens.is_some())
                );
                let bytes = std::fs::read(&path).unwrap();
                assert!(
                    bytes == whole,
                    "{:?} {:?} per_block {per_block}",
                    spec.op,
                    spec.dtype
                );
            }
        }
    }

    /// Short cases (and ops without heads) go the whole-case way, to the same bytes.
    #[test]
    fn generate_to_writes_generates_case() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("to.safetensors");
        for spec in [kda_spec(Dtype::Bf16), GenSpec::new(Op::TokenShift)] {
            let count = generate_to(&spec, &path).unwrap();
            assert_eq!(
                std::fs::read(&path).unwrap(),
                whole_bytes(&spec, dir.path())
            );
            let case = generate(&spec).unwrap();
            assert_eq!(
                count,
                case.tensors.len() + usize::from(case.cu_seqlens.is_some())
            );
        }
    }

    #[test]
    fn streaming_an_op_without_heads_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ts.safetensors");
        let e = generate_streamed(&GenSpec::new(Op::TokenShift), &path, 1).unwrap_err();
        assert!(e.to_string().contains("not token_shift"), "{e}");
        assert!(!path.exists());
    }

    /// A scale of 1e308 overflows the outputs. The streamed refusal names
    /// a tensor, the whole tensor's shape and an index in it where the
    /// whole case's truth is non-finite, and leaves no file.
    #[test]
    fn a_non_finite_streamed_truth_is_refused_and_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = GenSpec::new(Op::Kda);
        spec.shape = Some(vec![1, 32, 2, 2, 8, 4]);
        spec.scale = Some(1e308);
        let truth = Impl::NAIVE
            .compute(&generate(&spec).unwrap(), Compute::F64)
            .unwrap();
        spec.expected = true;
        assert!(generate(&spec).is_err());
        let path = dir.path().join("nan.safetensors");
        let e = generate_streamed(&spec, &path, 1).unwrap_err().to_string();
        assert!(!path.exists());
        assert!(e.contains("refusing to store a non-finite truth"), "{e}");
        let name = e.split('`').nth(1).unwrap();
        let at: usize = e
            .split("at flat index ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|i| i.parse().ok())
            .unwrap();
        let x = &truth[name];
        assert!(e.contains(&format!("of shape {:?}", x.shape())), "{e}");
        assert!(!x.iter().nth(at).unwrap().is_finite(), "{e}");
    }

    #[test]
    fn results_the_file_was_not_planned_for_are_refused() {
        let planned = vec![("o".to_string(), vec![1, 2]), ("dq".to_string(), vec![1])];
        let mut got = Tensors::new();
        got.insert("o".into(), ndarray::ArrayD::zeros(ndarray::IxDyn(&[1, 2])));
        let e = same_names(&planned, &got).unwrap_err().to_string();
        assert!(
            e.contains("[\"o\"]") && e.contains("[\"o\", \"dq\"]"),
            "{e}"
        );
        got.insert("dq".into(), ndarray::ArrayD::zeros(ndarray::IxDyn(&[1])));
        assert!(same_names(&planned, &got).is_ok());
        got.insert("dk".into(), ndarray::ArrayD::zeros(ndarray::IxDyn(&[1])));
        assert!(same_names(&planned, &got).is_err());
    }
}
