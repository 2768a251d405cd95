//! Kernel conventions: how a kernel's tensors differ from FLA's (issue 49).
//!
//! A [`Convention`] is declared once, as data: the gate's space, whether
//! gates and β arrive raw or activated, the state layout, packed `[T,H,D]`
//! or batched `[B,T,H,D]` tensors, the head mapping under grouped value
//! heads, the scale, the l2norm, varlen support and whether a backward
//! exists. [`Convention::to_kernel`] writes an FLA case's tensors the way
//! the kernel takes them, [`Convention::to_fla`] maps a kernel's tensors
//! (its inputs or its results) back; everything else in deltaref stays in
//! FLA's convention. The built-in conventions ([`BUILTIN`]) are in
//! [`builtin`], each citing the kernel source it was read from.
//!
//! Tensor names stay FLA's in every convention (`q k v g beta
//! initial_state o final_state …`); a case file written in a convention
//! records it under the metadata key `convention` ([`Convention::to_json`]),
//! which is what maps it back.
//!
//! Only the delta-rule operators with one state per value head (`kda`,
//! `gdn`) have conventions other than FLA's; `fla` applies to every op.

pub mod builtin;
pub mod file;

use ndarray::{ArrayD, Axis};
use serde_json::{json, Value};

use crate::case::{Case, Op};
use crate::outputs::Tensors;

pub use builtin::{find, names, BUILTIN, FLA};
pub use file::written_in;

/// The space the kernel's decay gate `g` lives in (when it takes an
/// activated gate; a raw gate is activated inside the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateSpace {
    /// Natural log: the decay is `exp(g)` (FLA).
    Ln,
    /// Base 2: the decay is `exp2(g)`, `g = g_fla · log2(e)`.
    Log2,
    /// Linear `α = exp(g_fla) ∈ (0, 1]` (FlashInfer GDN, opengdn).
    Linear,
}

impl GateSpace {
    pub fn name(self) -> &'static str {
        match self {
            GateSpace::Ln => "ln",
            GateSpace::Log2 => "log2",
            GateSpace::Linear => "linear",
        }
    }

    /// The kernel's gate value of FLA's natural-log `g`.
    pub fn from_ln(self, g: f64) -> f64 {
        match self {
            GateSpace::Ln => g,
            GateSpace::Log2 => g * std::f64::consts::LOG2_E,
            GateSpace::Linear => g.exp(),
        }
    }

    /// FLA's natural-log `g` of the kernel's gate value.
    pub fn to_ln(self, x: f64) -> f64 {
        match self {
            GateSpace::Ln => x,
            GateSpace::Log2 => x * std::f64::consts::LN_2,
            GateSpace::Linear => x.ln(),
        }
    }
}

/// Whether gates and β arrive raw (pre-activation, the kernel activates
/// them) or activated, or either (the kernel has FLA's switches).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// FLA's switches (`use_gate_in_kernel`, `use_beta_sigmoid_in_kernel`).
    Either,
    /// Always raw: FlashKDA's lower-bound gate and β logits.
    Raw,
    /// Always activated: log/linear decay and β as used.
    Activated,
}

/// How the state `S` (`[K, V]` per value head in FLA) is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateLayout {
    /// `[N, HV, K, V]` (FLA).
    KFirst,
    /// `[N, HV, V, K]`: FLA's state transposed.
    VFirst,
}

impl StateLayout {
    pub fn name(self) -> &'static str {
        match self {
            StateLayout::KFirst => "[N,H,K,V]",
            StateLayout::VFirst => "[N,H,V,K]",
        }
    }
}

/// Which q/k head value head `j` reads when `HV = r·H`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadMap {
    /// `j // r` (FLA's GVA).
    Grouped,
    /// `j % H` (ggml's broadcast).
    Tiled,
    /// The kernel has no grouped value heads: `HV = H`.
    Equal,
}

impl HeadMap {
    pub fn name(self) -> &'static str {
        match self {
            HeadMap::Grouped => "grouped `j // (HV/H)`",
            HeadMap::Tiled => "tiled `j % H`",
            HeadMap::Equal => "none (HV = H)",
        }
    }
}

/// The attention scale a kernel applies to `q`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleRule {
    /// An argument, default `K^-0.5` (FLA).
    Free,
    /// Always `K^-0.5`, no argument (ggml).
    Fixed,
    /// None at all: `o = S q` (opengdn); FLA's `scale = 1`.
    None,
}

/// Whether the kernel normalises q and k itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L2norm {
    /// FLA's `use_qk_l2norm_in_kernel` switch.
    Either,
    /// Always inside (FlashKDA).
    Inside,
    /// Never inside: the caller normalises (ggml, opengdn).
    Outside,
}

/// How a kernel's tensors differ from FLA's. See the module docs.
#[derive(Debug)]
pub struct Convention {
    /// `--convention` name.
    pub name: &'static str,
    /// The kernel and the source lines the declaration was read from.
    pub source: &'static str,
    /// The operators it applies to.
    pub ops: &'static [&'static str],
    pub gate: GateSpace,
    pub activation: Activation,
    pub state: StateLayout,
    /// Token tensors `[T, H, D]` (one packed batch, `cu_seqlens` required)
    /// instead of `[B, T, H, D]`.
    pub packed: bool,
    pub heads: HeadMap,
    pub scale: ScaleRule,
    pub l2norm: L2norm,
    /// Takes `cu_seqlens` (varlen, B = 1).
    pub varlen: bool,
    /// Takes a dense batch `B > 1` without `cu_seqlens`.
    pub dense: bool,
    /// Has a backward pass (gradients are judged when it returns them).
    pub backward: bool,
    /// Needs `K = V` (ggml: `S_k = S_v`).
    pub k_equals_v: bool,
}

/// A case the convention cannot express, in words naming what differs.
pub type Unsupported = String;

impl Convention {
    /// Whether the convention applies to operator `op`.
    pub fn applies_to(&self, op: Op) -> bool {
        self.ops.contains(&op.name())
    }

    /// Whether it is FLA's own (every mapping the identity).
    pub fn is_fla(&self) -> bool {
        std::ptr::eq(self, &FLA)
    }

    /// The metadata entry `convention` of a case written in it: its name
    /// and every field that maps it back.
    pub fn to_json(&self) -> Value {
        json!({
            "name": self.name,
            "ops": self.ops,
            "gate": self.gate.name(),
            "activation": match self.activation {
                Activation::Either => "either",
                Activation::Raw => "raw",
                Activation::Activated => "activated",
            },
            "state": self.state.name(),
            "packed": self.packed,
            "heads": match self.heads {
                HeadMap::Grouped => "grouped",
                HeadMap::Tiled => "tiled",
                HeadMap::Equal => "equal",
            },
            "scale": match self.scale {
                ScaleRule::Free => "free",
                ScaleRule::Fixed => "fixed",
                ScaleRule::None => "none",
            },
            "l2norm": match self.l2norm {
                L2norm::Either => "either",
                L2norm::Inside => "inside",
                L2norm::Outside => "outside",
            },
            "varlen": self.varlen,
            "dense": self.dense,
            "backward": self.backward,
            "k_equals_v": self.k_equals_v,
            "source": self.source,
        })
    }

    /// Refuses a case (FLA's convention) the kernel cannot take, saying
    /// which property of the case and what the convention needs.
    pub fn check(&self, case: &Case) -> Result<(), Unsupported> {
        let op = case.meta.op;
        if !self.applies_to(op) {
            return Err(format!(
                "convention {} applies to --op {}, not {}",
                self.name,
                self.ops.join(", "),
                op.name()
            ));
        }
        if self.is_fla() {
            return Ok(());
        }
        let dims = Dims::of(case)?;
        let flag = |k: &str| case.meta.flag(k);
        let raw_gate = flag("use_gate_in_kernel")
            || case
                .meta
                .options
                .get("gate")
                .and_then(Value::as_str)
                .is_some_and(|g| g != "none");
        let mut why = vec![];
        if self.heads == HeadMap::Equal && dims.hv != dims.h {
            why.push(format!(
                "it has no grouped value heads (HV = H), the case has H = {}, HV = {}",
                dims.h, dims.hv
            ));
        }
        if self.k_equals_v && dims.k != dims.v {
            why.push(format!(
                "it needs K = V, the case has K = {}, V = {}",
                dims.k, dims.v
            ));
        }
        match (case.cu_seqlens.is_some(), self.varlen, self.dense) {
            (true, false, _) => why.push("it takes no cu_seqlens (dense batches only)".into()),
            (false, _, false) if dims.b > 1 || self.packed => {
                why.push(format!("it takes packed sequences with cu_seqlens only, the case is a dense batch of B = {}", dims.b))
            }
            _ => {}
        }
        match self.activation {
            Activation::Raw if !(raw_gate && flag("use_beta_sigmoid_in_kernel")) => {
                why.push("its gate and β are raw (lower-bound gate in kernel, β logits): the case needs --gate lowerbound --beta-sigmoid".into())
            }
            Activation::Activated if raw_gate || flag("use_beta_sigmoid_in_kernel") => {
                why.push("it takes activated gates and β (no in-kernel gate or β sigmoid)".into())
            }
            _ => {}
        }
        match self.l2norm {
            L2norm::Inside if !flag("use_qk_l2norm_in_kernel") => why.push(
                "it always l2-normalises q and k inside: the case needs use_qk_l2norm_in_kernel"
                    .into(),
            ),
            L2norm::Outside if flag("use_qk_l2norm_in_kernel") => why.push(
                "it never l2-normalises q and k: the case must not set use_qk_l2norm_in_kernel"
                    .into(),
            ),
            _ => {}
        }
        let scale = case.meta.options.get("scale").and_then(Value::as_f64);
        let default = (dims.k as f64).powf(-0.5);
        match self.scale {
            ScaleRule::Fixed if scale.is_some_and(|s| s != default) => why.push(format!(
                "its scale is fixed at K^-0.5 = {default}, the case has {}",
                scale.unwrap_or(default)
            )),
            ScaleRule::None if scale != Some(1.0) => {
                why.push("it applies no scale: the case needs scale = 1".into())
            }
            _ => {}
        }
        if flag("state_v_first") {
            why.push(
                "the case stores its state V-first already (state_v_first); write it K-first"
                    .into(),
            );
        }
        if why.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "convention {} cannot express this case: {}",
                self.name,
                why.join("; ")
            ))
        }
    }

    /// The case's tensors (FLA's layout; inputs, upstream gradients and any
    /// results) as the kernel takes them. The case must pass [`Convention::check`].
    pub fn to_kernel(&self, case: &Case) -> Result<Tensors, Unsupported> {
        let dims = Dims::of(case)?;
        case.tensors
            .iter()
            .map(|(n, x)| {
                Ok((
                    n.clone(),
                    self.tensor_to_kernel(case.meta.op, n, x.clone(), &dims)?,
                ))
            })
            .collect()
    }

    /// Tensors in the kernel's layout (its inputs or its results, FLA's
    /// names) mapped back to FLA's layout, for a case of `op` with sizes
    /// `dims`. A tensor whose shape does not fit is an error naming it.
    pub fn to_fla(&self, op: Op, dims: &Dims, tensors: Tensors) -> Result<Tensors, Unsupported> {
        tensors
            .into_iter()
            .map(|(n, x)| {
                let y = self.tensor_to_fla(op, &n, x, dims)?;
                Ok((n, y))
            })
            .collect()
    }

    fn tensor_to_kernel(
        &self,
        op: Op,
        name: &str,
        mut x: ArrayD<f64>,
        d: &Dims,
    ) -> Result<ArrayD<f64>, Unsupported> {
        if self.is_fla() {
            return Ok(x);
        }
        let axes = op.info().axes_of(name).unwrap_or("");
        if self.heads == HeadMap::Tiled {
            if let Some(a) = value_head_axis(axes) {
                x = x.select(Axis(a), &tiled_sources(d.h, d.hv));
            }
        }
        if self.state == StateLayout::VFirst && is_state(axes) {
            x = swap_last_two(x);
        }
        if name == "g" && self.activation != Activation::Raw {
            x.mapv_inplace(|g| self.gate.from_ln(g));
        }
        if self.packed && axes.starts_with("B,") {
            x = x.index_axis_move(Axis(0), 0);
        }
        Ok(x)
    }

    fn tensor_to_fla(
        &self,
        op: Op,
        name: &str,
        mut x: ArrayD<f64>,
        d: &Dims,
    ) -> Result<ArrayD<f64>, Unsupported> {
        if self.is_fla() {
            return Ok(x);
        }
        let axes = op.info().axes_of(name).unwrap_or("");
        let rank = axes.split(',').count();
        if self.packed && axes.starts_with("B,") {
            if x.ndim() + 1 != rank {
                return Err(format!(
                    "`{name}`: convention {} stores it packed [T,…] with {} axes, got shape {:?}",
                    self.name,
                    rank - 1,
                    x.shape()
                ));
            }
            x = x.insert_axis(Axis(0));
        }
        if name == "g" && self.activation != Activation::Raw {
            x.mapv_inplace(|g| self.gate.to_ln(g));
        }
        if self.state == StateLayout::VFirst && is_state(axes) {
            x = swap_last_two(x);
        }
        if self.heads == HeadMap::Tiled {
            if let Some(a) = value_head_axis(axes) {
                if x.ndim() <= a || x.shape()[a] != d.hv {
                    return Err(format!(
                        "`{name}`: expected {} value heads on axis {a}, got shape {:?}",
                        d.hv,
                        x.shape()
                    ));
                }
                x = x.select(Axis(a), &invert(&tiled_sources(d.h, d.hv)));
            }
        }
        Ok(x)
    }
}

/// The sizes a convention's mappings need: `B, H, HV, K, V` of an FLA case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub h: usize,
    pub hv: usize,
    pub k: usize,
    pub v: usize,
}

impl Dims {
    /// Read off `q [B,T,H,K]` and `v [B,T,HV,V]` of a delta-rule case (an op
    /// without them gets `H = HV = 1`, which no mapping uses).
    pub fn of(case: &Case) -> Result<Dims, Unsupported> {
        let first = case.meta.op.first_input();
        let q = case
            .tensors
            .get(first)
            .ok_or_else(|| format!("the case has no `{first}`"))?;
        let s = q.shape();
        let (h, k) = if s.len() == 4 { (s[2], s[3]) } else { (1, 1) };
        let (hv, v) = match case.tensors.get("v").map(|v| v.shape().to_vec()) {
            Some(vs) if vs.len() == 4 && case.meta.op.info().axes_of("v") == Some("B,T,HV,V") => {
                (vs[2], vs[3])
            }
            _ => (h, k),
        };
        Ok(Dims {
            b: s[0],
            h,
            hv,
            k,
            v,
        })
    }
}

/// The axis of a tensor with axes `axes` that holds value heads (`HV`).
fn value_head_axis(axes: &str) -> Option<usize> {
    axes.split(',').position(|a| a == "HV")
}

/// Whether axes `axes` are a state's (`N,HV,K,V`).
fn is_state(axes: &str) -> bool {
    axes == "N,HV,K,V"
}

/// FLA's value head held at each position of a tiled kernel's value-head
/// axis: position `p` is read with q/k head `p % H` by the kernel, so it
/// must hold FLA's head `(p % H)·r + p / H` (one of the `r` heads FLA
/// groups on that q/k head).
pub fn tiled_sources(h: usize, hv: usize) -> Vec<usize> {
    let r = (hv / h.max(1)).max(1);
    (0..hv).map(|p| (p % h) * r + p / h).collect()
}

/// The inverse of a permutation.
pub fn invert(p: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; p.len()];
    for (i, &j) in p.iter().enumerate() {
        inv[j] = i;
    }
    inv
}

/// `x` with its last two axes swapped, in standard layout.
pub fn swap_last_two(x: ArrayD<f64>) -> ArrayD<f64> {
    let n = x.ndim();
    if n < 2 {
        return x;
    }
    let mut y = x;
    y.swap_axes(n - 2, n - 1);
    y.as_standard_layout().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiled_positions_hold_the_fla_head_their_qk_head_groups() {
        // H = 2, HV = 4 (r = 2): FLA groups value heads {0,1} on q/k head 0, {2,3} on 1.
        let src = tiled_sources(2, 4);
        assert_eq!(src, vec![0, 2, 1, 3]);
        for (p, &j) in src.iter().enumerate() {
            assert_eq!(
                p % 2,
                j / 2,
                "position {p} is read with q/k head p % H, FLA's head {j} with j // r"
            );
        }
        assert_eq!(invert(&src), vec![0, 2, 1, 3]);
        let src = tiled_sources(3, 6);
        for (p, &j) in src.iter().enumerate() {
            assert_eq!(p % 3, j / 2);
        }
        let inv = invert(&src);
        for (p, &j) in src.iter().enumerate() {
            assert_eq!(inv[j], p);
        }
    }

    #[test]
    fn gate_spaces_round_trip() {
        for s in [GateSpace::Ln, GateSpace::Log2, GateSpace::Linear] {
            for g in [-3.0, -0.01, 0.0] {
                assert!((s.to_ln(s.from_ln(g)) - g).abs() < 1e-14, "{s:?} {g}");
            }
        }
        assert!((GateSpace::Log2.from_ln(-1.0) - -std::f64::consts::LOG2_E).abs() < 1e-15);
        assert!((GateSpace::Linear.from_ln(-1.0) - (-1.0f64).exp()).abs() < 1e-15);
    }

    #[test]
    fn swapping_the_last_two_axes_transposes_each_state() {
        let x = ArrayD::from_shape_vec(vec![1, 1, 2, 3], (0..6).map(f64::from).collect()).unwrap();
        let y = swap_last_two(x.clone());
        assert_eq!(y.shape(), &[1, 1, 3, 2]);
        assert_eq!(y[[0, 0, 2, 1]], x[[0, 0, 1, 2]]);
        assert_eq!(swap_last_two(y), x);
    }
}
