"""Type stubs of the compiled module (python/src/lib.rs). Use the public
functions of :mod:`deltaref` instead of these."""

from os import PathLike
from typing import Optional

import numpy as np
import numpy.typing as npt

_F64 = npt.NDArray[np.float64]
_CaseParts = tuple[str, dict[str, _F64], dict[str, str], Optional[list[int]]]

def run(
    meta_json: str,
    tensors: dict[str, _F64],
    dtypes: dict[str, str],
    cu_seqlens: Optional[list[int]],
    impl_name: str,
    chunk_size: Optional[int],
    world: Optional[int],
    cuts: Optional[list[int]],
    cp_engine: Optional[str],
    precision: Optional[str],
    compute: str,
) -> tuple[str, dict[str, _F64]]: ...
def read_case(path: str | PathLike[str]) -> _CaseParts: ...
def read_candidate(path: str | PathLike[str], op: str) -> _CaseParts: ...
def write_case(
    path: str | PathLike[str],
    meta_json: str,
    tensors: dict[str, _F64],
    dtypes: dict[str, str],
    cu_seqlens: Optional[list[int]],
) -> int: ...
def gen(
    op: str,
    shape: Optional[list[int]],
    lengths: Optional[list[int]],
    seed: int,
    gate: str,
    lower_bound: Optional[float],
    use_qk_l2norm_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    initial_state: bool,
    scale: Optional[float],
    dtype: str,
    expected: bool,
) -> _CaseParts: ...
def verify(
    meta_json: str,
    tensors: dict[str, _F64],
    dtypes: dict[str, str],
    cu_seqlens: Optional[list[int]],
    candidate: Optional[dict[str, _F64]],
    max_ratio: float,
    case_name: str,
    candidate_name: str,
    impl_name: str,
    chunk_size: Optional[int],
    world: Optional[int],
    cuts: Optional[list[int]],
    cp_engine: Optional[str],
    precision: Optional[str],
    compute: Optional[str],
    forward_only: bool = ...,
    allow_partial: bool = ...,
) -> tuple[str, str, bool]: ...
def compare(
    reference: _F64, x: _F64, ratio: float, name: str
) -> tuple[float, float, int, bool, Optional[str]]: ...
def precision_names() -> list[str]: ...
