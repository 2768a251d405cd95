//! The CUDA C sources (compiled at run time by NVRTC) and the compile-time
//! sizes each module is built with.

use crate::error::{GpuError, Result};
use deltaref::Dtype;

/// Largest key dim: a state column lives in `KD` registers per thread.
pub const MAX_K: usize = 256;
/// Largest value dim: one thread per state column.
pub const MAX_V: usize = 1024;

/// Checks a problem against what the kernels are built for: `K ≤ MAX_K`,
/// `V ≤ MAX_V`, and `B·T` tokens indexable with 32-bit integers.
pub fn check_sizes(k: usize, v: usize, tokens: usize) -> Result<()> {
    if k > MAX_K || v > MAX_V {
        return Err(GpuError::Unsupported(format!(
            "K = {k}, V = {v}: the kernels hold a state column in registers (K ≤ {MAX_K}) \
             and run one thread per column (V ≤ {MAX_V})"
        )));
    }
    if tokens > i32::MAX as usize {
        return Err(GpuError::Unsupported(format!(
            "{tokens} tokens: the kernels index B·T with 32-bit integers"
        )));
    }
    Ok(())
}

/// Compile-time sizes of one module build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Defines {
    /// Inputs stored as bfloat16 (`IN_BF16`).
    pub in_bf16: bool,
    /// Key dimension: a state column lives in `KD` registers.
    pub kd: usize,
    /// Chunk size of the chunked kernels (`CHUNK`).
    pub chunk: usize,
}

/// One kernel source file; every source is compiled after `common.cuh`.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub name: &'static str,
    body: &'static str,
}

const COMMON: &str = include_str!("kernels/common.cuh");

pub const PREP: Source = Source {
    name: "prep",
    body: include_str!("kernels/prep.cu"),
};
pub const TOKEN_SHIFT: Source = Source {
    name: "token_shift",
    body: include_str!("kernels/token_shift.cu"),
};
pub const KDA_NAIVE: Source = Source {
    name: "kda_naive",
    body: include_str!("kernels/kda_naive.cu"),
};
pub const KDA_CHUNK: Source = Source {
    name: "kda_chunk",
    body: include_str!("kernels/kda_chunk.cu"),
};
pub const DPLR_NAIVE: Source = Source {
    name: "dplr_naive",
    body: include_str!("kernels/dplr_naive.cu"),
};
pub const CP: Source = Source {
    name: "cp",
    body: include_str!("kernels/cp.cu"),
};

/// Compile-time sizes of the pre/post-processing module (`prep.cu`, and the
/// edge conversions of `common.cuh`): only the storage dtype matters.
pub fn prep_defines(storage: Dtype) -> Defines {
    Defines {
        in_bf16: storage == Dtype::Bf16,
        kd: 0,
        chunk: 0,
    }
}

/// Every source, for compile checks.
pub const ALL: [Source; 6] = [PREP, TOKEN_SHIFT, KDA_NAIVE, KDA_CHUNK, DPLR_NAIVE, CP];

impl Source {
    /// A source of your own (e.g. to check an edited kernel); it is compiled
    /// after `common.cuh` like the built-in ones.
    pub const fn from_text(name: &'static str, body: &'static str) -> Source {
        Source { name, body }
    }

    /// The full translation unit for `d`.
    pub fn text(&self, d: Defines) -> String {
        format!(
            "#define IN_BF16 {}\n#define KD {}\n#define CHUNK {}\n{COMMON}\n{}",
            u8::from(d.in_bf16),
            d.kd,
            d.chunk,
            self.body
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_beyond_the_kernels_are_refused_with_the_limit() {
        assert!(check_sizes(MAX_K, MAX_V, i32::MAX as usize).is_ok());
        let e = check_sizes(MAX_K + 1, 8, 1).unwrap_err().to_string();
        assert!(e.contains("K ≤ 256"), "{e}");
        let e = check_sizes(8, MAX_V + 1, 1).unwrap_err().to_string();
        assert!(e.contains("V ≤ 1024"), "{e}");
        let e = check_sizes(8, 8, i32::MAX as usize + 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("32-bit"), "{e}");
    }

    #[test]
    fn the_translation_unit_starts_with_its_sizes() {
        let d = Defines {
            in_bf16: true,
            kd: 128,
            chunk: 64,
        };
        let t = KDA_CHUNK.text(d);
        assert!(t.starts_with("#define IN_BF16 1\n#define KD 128\n#define CHUNK 64\n"));
        assert!(t.contains("kda_chunk_intra"));
    }
}
