//! The operator registry: every operator declared once, in its own folder
//! (its `entry.rs`), and listed here in [`OPS`]. Tools (case files, the
//! CLI, `selfcheck`, the Python package, the GPU crate) work with an
//! operator through [`OpEntry`] without knowing which one it is: named
//! tensors in FLA's names go in, named tensors come out.
//!
//! An entry declares FLA's names and the axes of its tensors ([`OpInfo`]),
//! its options as a case file stores them ([`Options`], a JSON object with
//! FLA's keys), how `gen` draws a case of it, which engines compute it and
//! what their precision policies can round, and FLA's bf16 storage of its
//! kernels. The typed side (the crate-private trait `Registered`) is
//! written once per operator; the crate-private `Entry` turns it into an
//! [`OpEntry`], compiled here once, so no caller instantiates an engine of
//! its own, and tools reach an operator only through [`OPS`] ([`find`]).
//!
//! # Adding an operator
//! A folder `src/<op>/` implementing the operator contract ([`crate::op`])
//! and `Registered` (in its `entry.rs`, with the draws of its generated
//! cases: in a `spec.rs` beside it where the spec is public, as
//! [`crate::inputs::KdaSpec`] is), and one line in [`OPS`].

mod entry;

pub use entry::*;

/// Every operator, in the order tools list them.
pub static OPS: [&dyn OpEntry; 6] = [
    &crate::kda::entry::ENTRY,
    &crate::dplr::entry::ENTRY,
    &crate::token_shift::entry::ENTRY,
    &crate::gdn::entry::ENTRY,
    &crate::conv::entry::ENTRY,
    &crate::gdn2::entry::ENTRY,
];

/// The operator called `name` (`"kda"`, `"dplr"`, …).
pub fn find(name: &str) -> Option<&'static dyn OpEntry> {
    OPS.iter().copied().find(|op| op.info().name == name)
}

/// `kda, dplr, …`, for messages.
pub fn names() -> String {
    OPS.map(|op| op.info().name).join(", ")
}

impl GenFlag {
    /// The operators that take this flag, for messages.
    pub fn takers(self) -> Vec<&'static str> {
        OPS.iter()
            .filter(|op| op.info().gen_flags.contains(&self))
            .map(|op| op.info().name)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use ndarray::ArrayD;

    use super::*;

    #[test]
    fn every_operator_is_found_by_its_name_and_declares_its_axes() {
        for op in OPS {
            let info = op.info();
            assert!(std::ptr::eq(find(info.name).unwrap().info(), info));
            for name in info.inputs.iter().chain(&info.upstream) {
                assert!(info.axes_of(name).is_some(), "{}: {name}", info.name);
            }
            for name in info.results() {
                assert!(info.axes_of(name).is_some(), "{}: {name}", info.name);
            }
        }
        assert!(find("nope").is_none());
    }

    #[test]
    fn heads_are_read_along_the_axes_each_operator_declares() {
        let named = |shapes: &[(&str, &[usize])]| -> Tensors {
            shapes
                .iter()
                .map(|(n, s)| (n.to_string(), ArrayD::zeros(s.to_vec())))
                .collect()
        };
        let heads = |op: &str, t: &Tensors| {
            let options = Options::new();
            let p = Problem {
                tensors: t,
                cu_seqlens: None,
                options: &options,
            };
            find(op).unwrap().heads(p)
        };
        // KDA and GDN: H from q, HV from v (2 and 6: 3 value heads per H).
        let gated = named(&[("q", &[1, 4, 2, 8]), ("v", &[1, 4, 6, 5])]);
        assert_eq!(heads("kda", &gated), (2, 3));
        assert_eq!(heads("gdn", &gated), (2, 3));
        assert_eq!(heads("kda", &named(&[("v", &[1, 4, 6, 5])])), (1, 6));
        // DPLR and GDN-2 have one head axis, H.
        let plain = named(&[("q", &[1, 4, 3, 8]), ("v", &[1, 4, 3, 5])]);
        assert_eq!(heads("dplr", &plain), (3, 1));
        assert_eq!(heads("gdn2", &plain), (3, 1));
        // Token-shift and the convolution have none.
        let x = named(&[("x", &[1, 4, 7])]);
        assert_eq!(heads("token_shift", &x), (1, 1));
        assert_eq!(heads("causal_conv1d", &x), (1, 1));
    }

    #[test]
    fn a_chunk_size_is_one_of_flas() {
        assert_eq!(ChunkSize::new(32).unwrap().get(), 32);
        let e = ChunkSize::new(48).unwrap_err().to_string();
        assert!(e.contains("16, 32 or 64") && e.contains("48"), "{e}");
    }
}
