//! Case files written in a kernel's convention (`gen --convention X`) and
//! read back into FLA's layout.
//!
//! Such a file holds the case's tensors the way the kernel takes them
//! (FLA's names; its state layout, gate space, packing, value-head order)
//! and, beside the `case` entry, a `convention` metadata entry
//! ([`Convention::to_json`]) naming the convention: what maps it back.
//! Every reader of case files ([`crate::case::Case::read`]) maps such a
//! file back to FLA's layout first, so `verify`, `diagnose` and the rest
//! see the same case in every convention.

use serde_json::Value;

use super::{find, names, Convention, Dims, Unsupported};
use crate::case::{Case, CaseError, Dtype};
use crate::impls::{Compute, Impl};

/// The convention a case file's metadata `convention` entry names (`None`
/// without one, or for `fla`); an entry that is not a JSON object with a
/// built-in `name` is an error saying so.
pub fn written_in(entry: Option<&str>) -> Result<Option<&'static Convention>, String> {
    let Some(text) = entry else { return Ok(None) };
    let v: Value = serde_json::from_str(text)
        .map_err(|e| format!("metadata `convention` is not JSON ({e}): {text}"))?;
    let name = v.get("name").and_then(Value::as_str).ok_or_else(|| {
        format!(
            "metadata `convention` has no string `name` (expected one of {})",
            names()
        )
    })?;
    let conv = find(name).ok_or_else(|| {
        format!(
            "metadata `convention`: unknown `{name}` (expected one of {})",
            names()
        )
    })?;
    Ok((!conv.is_fla()).then_some(conv))
}

impl Dims {
    /// The sizes of a case whose tensors are in convention `conv`'s layout:
    /// `q` is `[B, T, H, K]`, or `[T, H, K]` (B = 1) when `conv` packs;
    /// `v` likewise with `HV, V`.
    pub fn of_kernel(conv: &Convention, case: &Case) -> Result<Dims, Unsupported> {
        let rank = if conv.packed { 3 } else { 4 };
        let shape = |n: &str| -> Result<Vec<usize>, Unsupported> {
            let x = case
                .tensors
                .get(n)
                .ok_or_else(|| format!("the case has no `{n}`"))?;
            if x.ndim() != rank {
                return Err(format!(
                    "`{n}`: convention {} stores it with {rank} axes, got shape {:?}",
                    conv.name,
                    x.shape()
                ));
            }
            Ok(x.shape()[rank - 2..].to_vec())
        };
        let first = case.meta.op.first_input();
        let (hk, hvv) = (shape(first)?, shape("v")?);
        let b = if conv.packed {
            1
        } else {
            case.tensors[first].shape()[0]
        };
        Ok(Dims {
            b,
            h: hk[0],
            hv: hvv[0],
            k: hk[1],
            v: hvv[1],
        })
    }
}

impl Convention {
    /// A case read in this convention's layout (inputs and any stored
    /// results) mapped back to FLA's layout; dtypes are kept.
    pub fn case_to_fla(&self, mut case: Case) -> Result<Case, Unsupported> {
        let dims = Dims::of_kernel(self, &case)?;
        let tensors = std::mem::take(&mut case.tensors);
        case.tensors = self.to_fla(case.meta.op, &dims, tensors)?;
        Ok(case)
    }

    /// The FLA case `case` (inputs, upstream gradients, any truth) written
    /// in this convention: the inputs rounded to `dtype` *in the kernel's
    /// layout* (a linear α is stored, not FLA's log gate), and, when
    /// `expected`, the f64 truth recomputed from those stored inputs and
    /// mapped into the layout too. Returns the case (kernel layout, FLA's
    /// names) and the bytes of its file.
    pub fn write_case(
        &'static self,
        case: &Case,
        dtype: Dtype,
        expected: bool,
    ) -> Result<(Case, Vec<u8>), CaseError> {
        let usage = |e: String| CaseError::Usage(format!("--convention {}: {e}", self.name));
        self.check(case).map_err(usage)?;
        let op = case.meta.op;
        let mut inputs = case.clone();
        inputs.tensors.retain(|n, _| {
            op.inputs().contains(&n.as_str()) || op.upstream().contains(&n.as_str())
        });
        let mut kernel = Case::new(case.meta.clone());
        kernel.cu_seqlens = case.cu_seqlens.clone();
        for (n, x) in self.to_kernel(&inputs).map_err(usage)? {
            let dt = case.dtypes.get(&n).copied().unwrap_or(dtype);
            kernel.insert(&n, x.mapv(|v| dt.round_f64(v)), dt);
        }
        if expected {
            // The truth of what the file stores: its inputs mapped back.
            let fla = self.case_to_fla(kernel.clone()).map_err(usage)?;
            let truth = Impl::NAIVE
                .compute(&fla, Compute::F64)
                .map_err(|e| usage(e.to_string()))?;
            let mut with = fla.clone();
            with.tensors.extend(truth.clone());
            let mapped = self.to_kernel(&with).map_err(usage)?;
            for n in truth.keys() {
                kernel.insert(n, mapped[n].clone(), Dtype::F64);
            }
        }
        let bytes = kernel.to_bytes_with_metadata(&[("convention", self.to_json().to_string())])?;
        Ok((kernel, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::Op;
    use crate::generate::{generate, GenSpec};

    fn gdn_case() -> Case {
        let mut s = GenSpec::new(Op::parse("gdn").unwrap());
        s.shape = Some(vec![1, 9, 2, 4, 4, 4]);
        s.initial_state = true;
        s.dtype = Dtype::F32;
        generate(&s).unwrap()
    }

    /// A case written in ggml's layout reads back (through `Case::from_bytes`)
    /// as the FLA case, its truth the oracle's on it.
    #[test]
    fn a_case_in_a_convention_reads_back_in_fla_layout() {
        let case = gdn_case();
        let ggml = find("ggml").unwrap();
        let (kernel, bytes) = ggml.write_case(&case, Dtype::F32, true).unwrap();
        assert_eq!(kernel.tensors["initial_state"].shape(), &[1, 4, 4, 4]);
        let back = Case::from_bytes(&bytes, "ggml case").unwrap();
        for (n, x) in &case.tensors {
            assert_eq!(back.tensors[n], *x, "{n}");
        }
        let truth = Impl::NAIVE.compute(&case, Compute::F64).unwrap();
        for (n, t) in &truth {
            let d = (&back.tensors[n] - t)
                .mapv(f64::abs)
                .fold(0.0, |a: f64, b| a.max(*b));
            assert!(d < 1e-12, "{n}: {d}");
        }
        // The kernel layout differs from FLA's: value heads tiled, state transposed.
        assert_ne!(kernel.tensors["v"], case.tensors["v"]);
    }

    #[test]
    fn a_bad_convention_entry_is_an_error() {
        assert!(written_in(Some("{\"name\": \"nope\"}"))
            .unwrap_err()
            .contains("unknown `nope`"));
        assert!(written_in(Some("[1]"))
            .unwrap_err()
            .contains("no string `name`"));
        assert!(written_in(Some("not json"))
            .unwrap_err()
            .contains("not JSON"));
        assert_eq!(
            written_in(Some("{\"name\": \"fla\"}"))
                .unwrap()
                .map(|c| c.name),
            None
        );
        let case = gdn_case();
        let e = find("opengdn")
            .unwrap()
            .write_case(&case, Dtype::F32, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--convention opengdn") && e.contains("HV = H"),
            "{e}"
        );
    }
}
