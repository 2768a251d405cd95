//! What an operator's registration declares ([`OpInfo`], options, draws,
//! engines, precision stages), the crate-private trait `Registered` an
//! operator's `entry.rs` implements, and the type-erased [`OpEntry`] built
//! from it. Nothing here names an operator: the list is [`super::OPS`].

use std::collections::BTreeMap;
use std::marker::PhantomData;

use ndarray::ArrayD;
use serde::de::{DeserializeOwned, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::conv::Activation;
use crate::cp::{self, plan::PlanSpec, Carry, CpOptions, RankDiag};
use crate::error::{Error, Result};
use crate::gates::Gate;
use crate::inputs::{Draw, Layout, Regime};
use crate::op::{self, Engine, OpSpec, Operator};
use crate::precision::{Feature, Policy};
use crate::scalar::Scalar;
use crate::tensor::cast;

/// Named tensors (FLA's names), in name order.
pub type Tensors = BTreeMap<String, ArrayD<f64>>;

/// An operator's options as a case file stores them: FLA's keyword names
/// and values (`{"use_qk_l2norm_in_kernel": true, "gate": "lowerbound",
/// "lower_bound": -5.0, …}`).
pub type Options = Map<String, Value>;

/// An operator's names and tensor layouts, as FLA has them.
#[derive(Debug)]
pub struct OpInfo {
    /// The case-file and CLI name.
    pub name: &'static str,
    /// FLA's functions that compute it (the chunked one first), which the
    /// Python package offers under the same names.
    pub fla: &'static [&'static str],
    /// Input tensors in FLA's argument order; `cu_seqlens` (integer) last.
    pub inputs: &'static [&'static str],
    /// The inputs a case may leave out.
    pub optional: &'static [&'static str],
    /// Upstream gradients: of the output, of the final state.
    pub upstream: [&'static str; 2],
    /// Forward results: the output, the final state.
    pub outputs: &'static [&'static str],
    pub grads: &'static [&'static str],
    /// The axes of every input and upstream gradient (`"B,T,H,K"`); a
    /// result has its input's (`dq` `q`'s, `o` `do`'s). `H` and `HV` are
    /// the head axes heads never mix along.
    pub axes: &'static [(&'static str, &'static str)],
    /// `gen --shape`: the sizes a case of it is drawn from, and its default.
    pub shape: &'static str,
    pub default_shape: &'static [usize],
    pub carry: Carry,
    /// Whether it has a chunked engine of its own (else `chunk` runs the naive one).
    pub chunked: bool,
    /// Its built-in case (`selfcheck`, examples).
    pub showcase: Showcase,
    /// The input regimes its draws know ([`Regime`]).
    pub regimes: &'static [Regime],
    /// Whether a long case can be generated and verified one block of
    /// heads at a time (every tensor has a head axis).
    pub streams_by_head: bool,
    /// The results FLA's kernels return in fp32 whatever the token dtype
    /// (final states, `dh0`, the gate parameters' gradients): a precision
    /// policy's output storage leaves them alone.
    pub fp32_results: &'static [&'static str],
    /// The `gen` flags that apply to it.
    pub gen_flags: &'static [GenFlag],
    /// FLA's stored intermediates of its chunked path the oracle can write.
    pub intermediates: &'static [&'static str],
}

impl OpInfo {
    /// The input or upstream gradient whose shape result `name` has (`dq`:
    /// `q`, `o`: `do`, `final_state`: `dht`, `dh0`: `initial_state`);
    /// an input or upstream gradient is its own.
    pub fn source_of(&self, name: &str) -> Option<&'static str> {
        let own = |n: &str| {
            self.inputs
                .iter()
                .chain(&self.upstream)
                .find(|i| **i == n)
                .copied()
        };
        if let Some(n) = own(name) {
            return Some(n);
        }
        if name == self.outputs[0] {
            return Some(self.upstream[0]);
        }
        if self.outputs.get(1) == Some(&name) {
            return Some(self.upstream[1]);
        }
        match name {
            "dh0" => own("initial_state"),
            "dcache" => own("cache"),
            _ => own(name.strip_prefix('d')?),
        }
    }

    /// The axes of tensor `name` (an input, upstream gradient or result).
    pub fn axes_of(&self, name: &str) -> Option<&'static str> {
        let source = self.source_of(name)?;
        self.axes
            .iter()
            .find(|(n, _)| *n == source)
            .map(|(_, a)| *a)
    }

    /// The axis of `name` that holds heads (`H`, `HV`, `H*K` or `HV*K`), if any.
    pub fn head_axis(&self, name: &str) -> Option<usize> {
        self.axes_of(name)?
            .split(',')
            .position(|a| a == "H" || a == "HV" || a.starts_with("H*") || a.starts_with("HV*"))
    }

    /// The first token input (`q` or `x`), where B and T are read.
    pub fn first_input(&self) -> &'static str {
        self.inputs[0]
    }

    /// Output and gradient names, the forward results first.
    pub fn results(&self) -> Vec<&'static str> {
        [self.outputs, self.grads].concat()
    }
}

/// An operator's built-in case: every option it has switched on, varlen
/// with empty and one-token sequences and an initial state (the lengths are
/// the caller's).
#[derive(Clone, Debug)]
pub struct Showcase {
    /// The sizes after `B, T` of [`OpInfo::shape`].
    pub dims: &'static [usize],
    /// Smaller sizes for finite differences (one run per input element).
    pub fd_dims: &'static [usize],
    pub seed: u64,
    pub flags: GenFlags,
}

/// The coefficients of an operator's up-front memory estimate (measured:
/// verify's memory test holds them against the peak heap of real runs),
/// for the options of one case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryModel {
    /// Bytes `gen` holds per input element drawing a case without its
    /// truth, in eighths of an element.
    pub draw_eighths: u64,
    /// Bytes per element of the largest input drawn alone (f64 and what it
    /// keeps beside it), besides the stored bytes.
    pub streamed_draw_bytes: u64,
    /// Input-sized copies a run holds (its inputs, results and prepared
    /// inputs), in quarters.
    pub copy_quarters: u64,
    /// Extra `q`/`k`-sized copies, in halves (an in-kernel l2norm).
    pub qk_halves: u64,
    /// Extra `[B, T, HV, K]` gate copies, in halves (an in-kernel gate).
    pub gate_halves: u64,
    /// The chunked engine's intermediates per token: `K`, `V` and `C`
    /// coefficients of its rows.
    pub chunk_rows: [u64; 3],
}

/// What the engines hold whatever the operator, for up-front memory
/// estimates: the only facts about the machinery behind the crate's
/// private `fast` wall that a caller needs (verify's memory estimate of a
/// case; the GPU's naive engine, which checkpoints on the CPU's spacing).
impl MemoryModel {
    /// Working buffers each thread keeps for reuse between (sequence, head)
    /// pairs: at most this many, of at most [`MemoryModel::MAX_KEPT`] bytes each.
    pub const KEPT: usize = crate::fast::scratch::KEPT;

    /// The largest working buffer a thread keeps for reuse, in bytes.
    pub const MAX_KEPT: usize = crate::fast::scratch::MAX_KEPT;

    /// Tokens per span of a chunked engine's long (sequence, head) pair: a
    /// longer pair's forward+backward holds one span's intermediates at a time.
    pub const SPAN_LEN: usize = crate::fast::spans::SPAN_LEN;

    /// Tokens per block of a checkpointed naive backward of `l` tokens at
    /// the `O(√L · K · V)` spacing: `⌈√l⌉`, at least 16. (The CPU engines
    /// shorten it where a block of states would not fit the cache:
    /// [`MemoryModel::held_states`].)
    pub fn block_len(l: usize) -> usize {
        crate::fast::sweep::block_len(l)
    }

    /// `[K, V]` states of `state_bytes` each that a naive engine's
    /// checkpointed backward of `l` tokens holds at once: its checkpoints
    /// and one block of replayed states.
    pub fn held_states(l: usize, state_bytes: usize) -> usize {
        crate::fast::sweep::held_states(l, state_bytes)
    }
}

/// A `gen` flag: the words `gen` offers every operator, each taken by the
/// operators that have what it sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenFlag {
    Gate,
    L2norm,
    BetaSigmoid,
    AllowNegEigval,
    InitialState,
    StateVFirst,
    Activation,
    Bias,
    Scale,
}

impl GenFlag {
    /// The command-line spelling.
    pub fn flag(self) -> &'static str {
        match self {
            GenFlag::Gate => "--gate",
            GenFlag::L2norm => "--l2norm",
            GenFlag::BetaSigmoid => "--beta-sigmoid",
            GenFlag::AllowNegEigval => "--allow-neg-eigval",
            GenFlag::InitialState => "--initial-state",
            GenFlag::StateVFirst => "--state-v-first",
            GenFlag::Activation => "--activation",
            GenFlag::Bias => "--bias",
            GenFlag::Scale => "--scale",
        }
    }
}

/// What `gen`'s flags ask of an operator's options and draw, in words
/// every operator understands. Each operator takes the flags it declares
/// ([`OpInfo::gen_flags`]) and turns them into its own options.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenFlags {
    /// The in-kernel gate (`--gate`, `--lower-bound`).
    pub gate: Gate,
    pub l2norm: bool,
    pub beta_sigmoid: bool,
    pub allow_neg_eigval: bool,
    pub initial_state: bool,
    pub state_v_first: bool,
    pub activation: Activation,
    pub bias: bool,
    pub scale: Option<f64>,
}

impl GenFlags {
    /// The flags given (set away from their defaults).
    pub fn given(&self) -> Vec<GenFlag> {
        let f = self;
        [
            (GenFlag::Gate, f.gate != Gate::None),
            (GenFlag::L2norm, f.l2norm),
            (GenFlag::BetaSigmoid, f.beta_sigmoid),
            (GenFlag::AllowNegEigval, f.allow_neg_eigval),
            (GenFlag::InitialState, f.initial_state),
            (GenFlag::StateVFirst, f.state_v_first),
            (GenFlag::Activation, f.activation != Activation::None),
            (GenFlag::Bias, f.bias),
            (GenFlag::Scale, f.scale.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, on)| on.then_some(flag))
        .collect()
    }

    /// Refuses a flag operator `info` does not take, naming the operators
    /// that do.
    pub fn check(&self, info: &OpInfo) -> std::result::Result<(), String> {
        match self
            .given()
            .into_iter()
            .find(|f| !info.gen_flags.contains(f))
        {
            None => Ok(()),
            Some(f) => Err(format!(
                "{} does not apply to --op {} (it applies to --op {})",
                f.flag(),
                info.name,
                f.takers().join(", ")
            )),
        }
    }
}

/// What an operator's draw needs besides its options.
#[derive(Clone, Debug)]
pub struct DrawRequest<'a> {
    pub layout: Layout,
    /// The sizes after `B, T` of [`OpInfo::shape`].
    pub dims: &'a [usize],
    pub flags: &'a GenFlags,
    pub regime: Regime,
    pub seed: u64,
    /// Without an in-kernel l2norm, draw unit-norm keys (FLA's tests do).
    pub unit_norm_keys: bool,
}

/// The chunk size of a chunked engine: 16, 32 or 64, the sizes FLA's
/// kernels use; checked once, where it is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChunkSize(usize);

impl ChunkSize {
    pub const ALL: [usize; 3] = [16, 32, 64];
    /// FLA's default (`chunk_kda`'s `BT`).
    pub const DEFAULT: ChunkSize = ChunkSize(64);

    pub fn new(c: usize) -> Result<ChunkSize> {
        if ChunkSize::ALL.contains(&c) {
            Ok(ChunkSize(c))
        } else {
            Err(Error::option(
                "chunk_size",
                format!("must be 16, 32 or 64, got {c}"),
            ))
        }
    }

    pub fn get(self) -> usize {
        self.0
    }
}

impl std::fmt::Display for ChunkSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The local engine: the naive recurrence or the chunked form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    Naive,
    Chunk(ChunkSize),
}

/// The scalar a run computes in: `f64` (the truth) or `f32` (the same code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compute {
    F64,
    F32,
}

impl Compute {
    pub fn name(self) -> &'static str {
        match self {
            Compute::F64 => "f64",
            Compute::F32 => "f32",
        }
    }
}

impl std::str::FromStr for Compute {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Compute, String> {
        match s {
            "f64" => Ok(Compute::F64),
            "f32" => Ok(Compute::F32),
            _ => Err(format!("expected f64 or f32, got `{s}`")),
        }
    }
}

impl std::fmt::Display for Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How one run computes: the engine, the scalar, the chunked engine's
/// precision policy, and simulated context parallel.
#[derive(Clone, Copy, Debug)]
pub struct Job<'a> {
    pub engine: EngineKind,
    pub compute: Compute,
    /// Stage rounding of the chunked engine (CP's own is in `cp`'s options).
    pub policy: &'a Policy,
    pub cp: Option<(&'a PlanSpec, &'a CpOptions)>,
}

/// One problem in named tensors: the inputs (FLA's names, widened to f64),
/// `cu_seqlens`, and the options as a case stores them.
#[derive(Clone, Copy, Debug)]
pub struct Problem<'a> {
    pub tensors: &'a Tensors,
    pub cu_seqlens: Option<&'a [i64]>,
    pub options: &'a Options,
}

/// One chunk's place in a run's intermediates: batch row, tokens
/// `[start, end)`, its index along `h`'s NT axis, and the CP rank holding
/// it (0 without CP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ChunkPos {
    pub batch: usize,
    pub start: usize,
    pub end: usize,
    pub index: usize,
    pub rank: usize,
}

/// A run's results and, under CP, the per-rank diagnostics (widened to f64).
pub(crate) type Outcome = (Tensors, Vec<RankDiag<f64>>);

/// An operator as tools see it: named tensors in, named tensors out.
pub trait OpEntry: Sync {
    fn info(&self) -> &'static OpInfo;

    /// The option keys a case of it may hold (FLA's names).
    fn option_keys(&self) -> &'static [&'static str];

    /// Checks a case's options (keys and values); the message names the key.
    fn check_options(&self, o: &Options) -> std::result::Result<(), String>;

    /// The options `gen`'s flags ask for (refusing flags it does not take).
    fn gen_options(&self, f: &GenFlags) -> std::result::Result<Options, String>;

    /// The tensors of a drawn case (inputs and upstream gradients), one
    /// draw each, each its own random stream.
    fn draws(&self, r: &DrawRequest<'_>, o: &Options) -> Vec<Draw>;

    /// Validates a problem and its upstream gradients `(do, dht)` where
    /// they are (nothing token-sized is copied).
    fn validate(&self, x: Problem<'_>, d_o: &ArrayD<f64>, dht: Option<&ArrayD<f64>>) -> Result<()>;

    /// Every output and gradient of the loss `Σ o·do + Σ final·dht`, under
    /// FLA's names. The inputs are moved in (a long case is held once).
    fn forward_backward(
        &self,
        job: &Job<'_>,
        inputs: Tensors,
        cu_seqlens: Option<Vec<i64>>,
        options: &Options,
        upstream: (ArrayD<f64>, Option<ArrayD<f64>>),
    ) -> Result<Outcome>;

    /// The outputs alone (no backward pass).
    fn forward(&self, job: &Job<'_>, x: Problem<'_>) -> Result<Tensors>;

    /// What a precision policy may ask of the engine `engine` (its own
    /// stages; the inputs, outputs and CP's stages are the caller's).
    fn features(&self, engine: EngineKind) -> &'static [Feature];

    /// FLA's bf16 kernels' storage for a case with options `o`, with
    /// (`cp`) or without context parallel.
    fn fla_bf16(&self, o: &Options, cp: bool) -> Policy;

    /// The number of query/key heads H of a problem, and the value heads
    /// per q/k head (1 where the operator has no heads).
    fn heads(&self, x: Problem<'_>) -> (usize, usize);

    /// The memory estimate's coefficients for a case with options `o`.
    fn memory(&self, o: &Options) -> MemoryModel;

    /// FLA's stored forward intermediates of the chunked path
    /// ([`OpInfo::intermediates`]) computed as `job` says (a chunked
    /// engine), with the chunk layout; `up` gives CP its merged `dht`.
    fn intermediates(
        &self,
        job: &Job<'_>,
        x: Problem<'_>,
        up: (&ArrayD<f64>, Option<&ArrayD<f64>>),
    ) -> Result<(Tensors, Vec<ChunkPos>)>;
}

/// The typed side of an operator's registry entry, written once per
/// operator in its `entry.rs`: its [`OpInfo`], its engines, its case
/// options' serde type and what only it knows (its flags, draws, bf16
/// storage, typed inputs, validation, memory). What every operator does
/// the same way (option keys, case parsing, engine construction, head
/// counts read from the axes) is written here once, as default methods.
pub(crate) trait Registered: Operator<f64> + Operator<f32> + Sync {
    /// FLA's names and the tensor axes ([`OpEntry::info`]).
    const INFO: &'static OpInfo;
    /// The naive engine, built as its `Default`.
    type Naive: Engine<f64, Op = Self> + Engine<f32, Op = Self> + Default;
    /// The chunked engine (an operator without one names its naive one).
    type Chunk: Engine<f64, Op = Self> + Engine<f32, Op = Self> + Build;
    /// The options as a case file stores them: a serde struct of FLA's
    /// keys that refuses unknown ones.
    type Case: DeserializeOwned;

    /// The typed options of parsed case options (a bad combination
    /// refused, the message naming the key).
    fn typed(c: Self::Case) -> std::result::Result<<Self as OpSpec>::Options, String>;

    /// The option keys ([`OpEntry::option_keys`]): the fields of [`Registered::Case`].
    fn option_keys() -> &'static [&'static str] {
        option_keys::<Self::Case>()
    }

    /// The typed options of a case's options (unknown keys refused).
    fn options(o: &Options) -> std::result::Result<<Self as OpSpec>::Options, String> {
        Self::typed(parse_options::<Self::Case>(Self::INFO.name, o)?)
    }

    fn naive() -> Self::Naive {
        Self::Naive::default()
    }

    fn chunk(c: ChunkSize, policy: &Policy) -> Self::Chunk {
        Self::Chunk::build(c, policy)
    }

    /// `(H, value heads per H)` of a problem's tensors, read along the axes
    /// [`OpInfo::axes`] names `H` and `HV`: `H` from the first input (1
    /// without one), `HV` from the first input laid out along it (KDA's
    /// and GDN's `v`; `H` where no input is).
    fn heads(t: &Tensors) -> (usize, usize) {
        let info = Self::INFO;
        let along = |name: &str, axis: &str| -> Option<usize> {
            let i = info.axes_of(name)?.split(',').position(|a| a == axis)?;
            t.get(name)?.shape().get(i).copied()
        };
        let h = along(info.first_input(), "H").unwrap_or(1).max(1);
        let value_input = info.inputs.iter().find(|n| {
            info.axes_of(n)
                .is_some_and(|a| a.split(',').any(|x| x == "HV"))
        });
        let hv = value_input.and_then(|n| along(n, "HV")).unwrap_or(h);
        (h, (hv / h).max(1))
    }

    fn gen_options(f: &GenFlags) -> std::result::Result<Options, String>;
    fn draws(r: &DrawRequest<'_>, opt: &<Self as OpSpec>::Options) -> Vec<Draw>;
    fn fla_bf16(opt: &<Self as OpSpec>::Options, cp: bool) -> Policy;

    /// The typed inputs, taking the named tensors out of `t` (required
    /// ones missing: an error naming them).
    fn inputs(t: &mut Tensors, cu: Option<Vec<i64>>) -> Result<<Self as Operator<f64>>::Inputs>;
    /// Validates borrowed inputs and the upstream gradients.
    fn validate(
        t: &Tensors,
        cu: Option<&[i64]>,
        opt: &<Self as OpSpec>::Options,
        d_o: &ArrayD<f64>,
        dht: Option<&ArrayD<f64>>,
    ) -> Result<()>;
    fn memory(opt: &<Self as OpSpec>::Options) -> MemoryModel;

    /// [`OpEntry::intermediates`] on typed inputs; an operator whose
    /// entry declares none refuses.
    fn intermediates(
        _job: &Job<'_>,
        _x: &<Self as Operator<f64>>::Inputs,
        _opt: &<Self as OpSpec>::Options,
        _up: (&ArrayD<f64>, Option<&ArrayD<f64>>),
    ) -> Result<(Tensors, Vec<ChunkPos>)> {
        Err(Error::option(
            "intermediates",
            format!("op {} declares no stored intermediates", Self::INFO.name),
        ))
    }
}

/// A chunked engine as the registry builds it for a job, from its chunk
/// size and precision policy (an operator without a chunked form builds
/// its one engine and ignores both).
pub(crate) trait Build {
    /// The stages its precision policy can round ([`OpEntry::features`]).
    const FEATURES: &'static [Feature] = &[];

    fn build(c: ChunkSize, policy: &Policy) -> Self;
}

/// Draws of tensors already drawn (an operator whose generator draws
/// everything at once), under their case-file names; absent ones left out.
pub(crate) fn eager_draws(named: Vec<(&'static str, Option<ArrayD<f64>>)>) -> Vec<Draw> {
    named
        .into_iter()
        .filter_map(|(name, t)| {
            let t = t?;
            Some(Draw::new(name, t.shape().to_vec(), move |_| t.clone()))
        })
        .collect()
}

/// A required tensor taken out of `t`, or an error naming it and `op`.
pub fn take(t: &mut Tensors, name: &str, op: &str) -> Result<ArrayD<f64>> {
    t.remove(name)
        .ok_or_else(|| Error::missing(name, format!("required input of op {op}")))
}

/// A required tensor of `t`, borrowed, or an error naming it and `op`.
pub fn need<'t>(t: &'t Tensors, name: &str, op: &str) -> Result<&'t ArrayD<f64>> {
    t.get(name)
        .ok_or_else(|| Error::missing(name, format!("required input of op {op}")))
}

/// Case options as the serde type `T` (FLA's keys): every unknown or
/// mistyped key is an error naming it, the operator `op` and what was
/// expected.
pub fn parse_options<T: DeserializeOwned>(op: &str, o: &Options) -> std::result::Result<T, String> {
    if let Some(k) = o.keys().find(|k| !option_keys::<T>().contains(&k.as_str())) {
        return Err(format!(
            "unknown key `{k}` in `case` (op {op} takes {})",
            option_keys::<T>().join(", ")
        ));
    }
    serde_json::from_value(Value::Object(o.clone())).map_err(|e| {
        // serde's message names the type expected, not the key: read each alone.
        o.iter()
            .find_map(|(k, v)| {
                let one = Map::from_iter([(k.clone(), v.clone())]);
                let e = serde_json::from_value::<T>(Value::Object(one)).err()?;
                Some(format!("key `{k}` of op {op}: {e}"))
            })
            .unwrap_or_else(|| format!("`case` of op {op}: {e}"))
    })
}

/// `x` (a serde struct of options) as case options.
pub fn to_options<T: Serialize>(x: &T) -> Options {
    match serde_json::to_value(x) {
        Ok(Value::Object(m)) => m,
        _ => unreachable!("options types are structs of JSON values"),
    }
}

/// The field names of an options type, as serde's derive declares them.
pub fn option_keys<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(FieldNames(&mut fields));
    fields
}

/// A deserializer that only records the fields a struct asks for.
struct FieldNames<'a>(&'a mut &'static [&'static str]);

impl<'de> serde::Deserializer<'de> for FieldNames<'_> {
    type Error = serde::de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> std::result::Result<V::Value, Self::Error> {
        Err(serde::de::Error::custom(
            "only a struct's field names are read",
        ))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        *self.0 = fields;
        self.deserialize_any(v)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
        byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map
        enum identifier ignored_any
    }
}

/// The [`OpEntry`] of a [`Registered`] operator.
pub(crate) struct Entry<O>(PhantomData<fn() -> O>);

impl<O> Entry<O> {
    pub(crate) const fn new() -> Self {
        Entry(PhantomData)
    }
}

impl<O> Default for Entry<O> {
    fn default() -> Self {
        Entry::new()
    }
}

fn typed_options<O: Registered>(o: &Options) -> Result<<O as OpSpec>::Options> {
    O::options(o).map_err(|why| Error::option("case", why))
}

impl<O: Registered> OpEntry for Entry<O>
where
    <O as Operator<f64>>::Inputs: 'static,
    <O as Operator<f32>>::Inputs: 'static,
{
    fn info(&self) -> &'static OpInfo {
        O::INFO
    }

    fn option_keys(&self) -> &'static [&'static str] {
        O::option_keys()
    }

    fn check_options(&self, o: &Options) -> std::result::Result<(), String> {
        O::options(o).map(drop)
    }

    fn gen_options(&self, f: &GenFlags) -> std::result::Result<Options, String> {
        f.check(O::INFO)?;
        O::gen_options(f)
    }

    fn draws(&self, r: &DrawRequest<'_>, o: &Options) -> Vec<Draw> {
        match O::options(o) {
            Ok(opt) => O::draws(r, &opt),
            Err(_) => vec![],
        }
    }

    fn validate(&self, x: Problem<'_>, d_o: &ArrayD<f64>, dht: Option<&ArrayD<f64>>) -> Result<()> {
        let opt = typed_options::<O>(x.options)?;
        O::validate(x.tensors, x.cu_seqlens, &opt, d_o, dht)
    }

    fn forward_backward(
        &self,
        job: &Job<'_>,
        mut inputs: Tensors,
        cu_seqlens: Option<Vec<i64>>,
        options: &Options,
        (d_o, dht): (ArrayD<f64>, Option<ArrayD<f64>>),
    ) -> Result<Outcome> {
        let opt = typed_options::<O>(options)?;
        let x = O::inputs(&mut inputs, cu_seqlens)?;
        drop(inputs);
        let up = (d_o, dht.as_ref());
        match job.compute {
            Compute::F64 => on_engine::<f64, O, _>(job, BackwardJob { x, up, cp: job.cp }, &opt),
            Compute::F32 => on_engine::<f32, O, _>(job, BackwardJob { x, up, cp: job.cp }, &opt),
        }
    }

    fn forward(&self, job: &Job<'_>, p: Problem<'_>) -> Result<Tensors> {
        let opt = typed_options::<O>(p.options)?;
        let mut t = p.tensors.clone();
        let x = O::inputs(&mut t, p.cu_seqlens.map(<[i64]>::to_vec))?;
        drop(t);
        match job.compute {
            Compute::F64 => on_engine::<f64, O, _>(job, ForwardJob { x, cp: job.cp }, &opt),
            Compute::F32 => on_engine::<f32, O, _>(job, ForwardJob { x, cp: job.cp }, &opt),
        }
    }

    fn features(&self, engine: EngineKind) -> &'static [Feature] {
        match engine {
            EngineKind::Naive => &[],
            EngineKind::Chunk(_) => <O::Chunk as Build>::FEATURES,
        }
    }

    fn fla_bf16(&self, o: &Options, cp: bool) -> Policy {
        O::options(o).map_or_else(|_| Policy::exact(), |opt| O::fla_bf16(&opt, cp))
    }

    fn heads(&self, x: Problem<'_>) -> (usize, usize) {
        O::heads(x.tensors)
    }

    fn intermediates(
        &self,
        job: &Job<'_>,
        p: Problem<'_>,
        up: (&ArrayD<f64>, Option<&ArrayD<f64>>),
    ) -> Result<(Tensors, Vec<ChunkPos>)> {
        let opt = typed_options::<O>(p.options)?;
        let mut t = p.tensors.clone();
        let x = O::inputs(&mut t, p.cu_seqlens.map(<[i64]>::to_vec))?;
        O::intermediates(job, &x, &opt, up)
    }

    fn memory(&self, o: &Options) -> MemoryModel {
        let opt = O::options(o).unwrap_or_else(|_| {
            O::options(&Options::new()).expect("an op's default options parse")
        });
        O::memory(&opt)
    }
}

/// Work generic over the engine, run by [`on_engine`] on the one the job names.
trait EngineJob<T: Scalar, O: Registered + Operator<T>> {
    type Out;
    fn run<E: Engine<T, Op = O>>(
        self,
        engine: &E,
        opt: &<O as OpSpec>::Options,
    ) -> Result<Self::Out>;
}

/// Runs `job` on the engine `j` names: the one place that maps an engine
/// kind to an engine value.
fn on_engine<T: Scalar, O: Registered + Operator<T>, J: EngineJob<T, O>>(
    j: &Job<'_>,
    job: J,
    opt: &<O as OpSpec>::Options,
) -> Result<J::Out>
where
    O::Naive: Engine<T, Op = O>,
    O::Chunk: Engine<T, Op = O>,
{
    match j.engine {
        EngineKind::Naive => job.run(&O::naive(), opt),
        EngineKind::Chunk(c) => job.run(&O::chunk(c, j.policy), opt),
    }
}

/// Outputs and gradients, under simulated CP when asked.
struct BackwardJob<'a, O: Operator<f64>> {
    x: <O as Operator<f64>>::Inputs,
    up: (ArrayD<f64>, Option<&'a ArrayD<f64>>),
    cp: Option<(&'a PlanSpec, &'a CpOptions)>,
}

impl<T: Scalar, O: Registered + Operator<T>> EngineJob<T, O> for BackwardJob<'_, O>
where
    <O as Operator<f64>>::Inputs: 'static,
    <O as Operator<T>>::Inputs: 'static,
{
    type Out = Outcome;

    fn run<E: Engine<T, Op = O>>(
        self,
        engine: &E,
        opt: &<O as OpSpec>::Options,
    ) -> Result<Outcome> {
        let (d_o, dht) = self.up;
        let (xt, d_o_t) = narrow_owned::<T, O>(self.x, d_o);
        let dht_t = dht.map(cast::<f64, T>);
        let opts = O::all_outputs(opt);
        match self.cp {
            None => {
                let (out, gr) = op::forward_backward(engine, &xt, &opts, &d_o_t, dht_t.as_ref())?;
                drop((xt, d_o_t));
                Ok((named::<T, O>(&out, Some(&gr)), vec![]))
            }
            Some((plan, cpo)) => {
                let (out, gr, diags) =
                    cp::forward_backward(engine, &xt, &opts, &d_o_t, dht_t.as_ref(), plan, cpo)?;
                drop((xt, d_o_t));
                let diags = diags.into_iter().map(|d| d.widen()).collect();
                Ok((named::<T, O>(&out, Some(&gr)), diags))
            }
        }
    }
}

/// The outputs alone, under simulated CP when asked.
struct ForwardJob<'a, O: Operator<f64>> {
    x: <O as Operator<f64>>::Inputs,
    cp: Option<(&'a PlanSpec, &'a CpOptions)>,
}

impl<T: Scalar, O: Registered + Operator<T>> EngineJob<T, O> for ForwardJob<'_, O> {
    type Out = Tensors;

    fn run<E: Engine<T, Op = O>>(
        self,
        engine: &E,
        opt: &<O as OpSpec>::Options,
    ) -> Result<Tensors> {
        let xt = <O as Operator<T>>::narrow(&self.x);
        let opts = O::all_outputs(opt);
        let out = match self.cp {
            None => op::forward(engine, &xt, &opts)?,
            Some((plan, cpo)) => cp::forward(engine, &xt, &opts, plan, cpo)?.0,
        };
        Ok(named::<T, O>(&out, None))
    }
}

/// Outputs and (when given) gradients of operator `O` under FLA's names
/// ([`OpSpec::OUTPUTS`], [`OpSpec::GRADS`]), absent ones left out, each
/// widened to f64 with its shape: the one map every comparison reads
/// (`o` `[B, T, HV, V]`, `final_state` `[N, HV, K, V]`, `dq` as `q`, …).
pub fn named<T: Scalar, O: Operator<T>>(out: &O::Outputs, gr: Option<&O::Grads>) -> Tensors {
    op::named::<T, O>(out, gr)
        .into_iter()
        .map(|(name, t)| (name.to_string(), cast(t)))
        .collect()
}

/// The inputs and `do` narrowed to `T`, each f64 original freed as soon as
/// it is narrowed: taken by value so that a long case is held once (in
/// `T`), not twice. In f64 they are moved, not copied.
fn narrow_owned<T: Scalar, O: Operator<f64> + Operator<T>>(
    x: <O as Operator<f64>>::Inputs,
    d_o: ArrayD<f64>,
) -> (<O as Operator<T>>::Inputs, ArrayD<T>)
where
    <O as Operator<f64>>::Inputs: 'static,
    <O as Operator<T>>::Inputs: 'static,
{
    let xt = same_type(x).unwrap_or_else(|x| <O as Operator<T>>::narrow(&x));
    let d_o = same_type(d_o).unwrap_or_else(|d_o| cast(&d_o));
    (xt, d_o)
}

/// `x` itself when `U` is its type (a move), else `x` back.
fn same_type<X: 'static, U: 'static>(x: X) -> std::result::Result<U, X> {
    let mut slot = Some(x);
    match (&mut slot as &mut dyn std::any::Any).downcast_mut::<Option<U>>() {
        Some(u) => Ok(u.take().expect("just filled")),
        None => Err(slot.take().expect("just filled")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_type_moves_the_tensor_and_declines_another_type() {
        let a = ArrayD::from_shape_vec(vec![2, 3], (0..6).map(f64::from).collect()).unwrap();
        let at = a.as_ptr();
        let moved: ArrayD<f64> = same_type(a).expect("f64 to f64");
        assert_eq!(moved.as_ptr(), at, "moved, not copied");
        let back = same_type::<ArrayD<f64>, ArrayD<f32>>(moved).expect_err("f64 is not f32");
        assert_eq!(back.as_ptr(), at);
    }
}
