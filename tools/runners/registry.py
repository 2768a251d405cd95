"""Every runner by name: (module convention, why_not, run, forward_only)."""

from . import dao_conv1d, fla, flashkda, opengdn

IMPLS = {
    "fla-chunk": (fla.CONVENTION, fla.chunk_why_not, fla.chunk_run, False),
    "fla-chunk-fwd": (fla.CONVENTION, fla.chunk_why_not, fla.chunk_fwd_run, True),
    "fla-chunk-gdn2": (fla.CONVENTION, fla.gdn2_why_not, fla.gdn2_run, False),
    "fla-fused-recurrent": (fla.CONVENTION, fla.recurrent_why_not, fla.recurrent_run, True),
    "flashkda": (flashkda.CONVENTION, flashkda.why_not, flashkda.run, True),
    "causal-conv1d": (dao_conv1d.CONVENTION, dao_conv1d.why_not, dao_conv1d.make(False), False),
    "causal-conv1d-cl": (dao_conv1d.CONVENTION, dao_conv1d.why_not, dao_conv1d.make(True), False),
} | {
    f"opengdn-{p}": (opengdn.CONVENTION, opengdn.why_not, opengdn.make(p), False) for p in opengdn.PATHS
}
