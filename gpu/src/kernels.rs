//! The CUDA C sources (compiled at run time by NVRTC) and the compile-time
//! sizes each module is built with.

use crate::device::Storage;

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
pub fn prep_defines(storage: Storage) -> Defines {
    Defines {
        in_bf16: storage == Storage::Bf16,
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
