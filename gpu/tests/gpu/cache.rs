//! The PTX disk cache: one file per distinct build, written whole.

use deltaref_gpu::device::PtxCache;
use deltaref_gpu::kernels::{Defines, KDA_CHUNK, PREP};

fn defines(kd: usize) -> Defines {
    Defines {
        in_bf16: false,
        kd,
        chunk: 64,
    }
}

#[test]
fn each_build_has_its_own_entry() {
    let dir = tempfile::tempdir().unwrap();
    let c = PtxCache::at(dir.path().join("ptx")).expect("cache folder");
    let a = c.path(&KDA_CHUNK, defines(64), "compute_90");
    assert_eq!(a, c.path(&KDA_CHUNK, defines(64), "compute_90"));
    for other in [
        c.path(&KDA_CHUNK, defines(128), "compute_90"),
        c.path(&KDA_CHUNK, defines(64), "compute_80"),
        c.path(&PREP, defines(64), "compute_90"),
    ] {
        assert_ne!(a, other);
    }
    assert!(a
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("kda_chunk-"));
}

#[test]
fn put_then_get_returns_the_text_and_leaves_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let c = PtxCache::at(dir.path().to_path_buf()).expect("cache folder");
    assert!(c.get(&PREP, defines(8), "compute_90").is_none());
    c.put(&PREP, defines(8), "compute_90", ".version 8.0\n// ptx");
    let got = c.get(&PREP, defines(8), "compute_90").expect("cached");
    assert_eq!(got.to_src(), ".version 8.0\n// ptx");
    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(files.len(), 1, "{files:?}");
}
