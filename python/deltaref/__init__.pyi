from os import PathLike
from typing import Any, Literal, Mapping, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

# NumPy arrays, PyTorch tensors, JAX arrays: anything with __array__ or __dlpack__.
ArrayLike = Any
Impl = Literal["naive", "chunk", "cp", "gpu-naive", "gpu-chunk", "gpu-cp"]
CpSpec = Mapping[str, Any]  # {"world": N} (optionally "layout": "zigzag") or {"cuts": [...]}, optionally "engine"
_Path = Union[str, PathLike[str]]

PRECISIONS: tuple[str, ...]

class Results(dict[str, Any]):
    impl: str
    def __getattr__(self, name: str) -> Any: ...

def naive_recurrent_kda(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, beta: ArrayLike,
    scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
    output_final_state: bool = False, *, cu_seqlens: Optional[ArrayLike] = None,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
    safe_gate: bool = False, lower_bound: Optional[float] = None,
    A_log: Optional[ArrayLike] = None, dt_bias: Optional[ArrayLike] = None,
    impl: Optional[Impl] = None, chunk_size: Optional[int] = None,
    cp: Optional[CpSpec] = None, precision: Optional[str] = None,
) -> tuple[Any, Optional[Any]]: ...
def chunk_kda(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, beta: ArrayLike,
    scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False, safe_gate: bool = False,
    lower_bound: Optional[float] = None, disable_recompute: bool = False,
    return_intermediate_states: bool = False, state_v_first: bool = False,
    cu_seqlens: Optional[ArrayLike] = None, cu_seqlens_cpu: Optional[ArrayLike] = None, *,
    A_log: Optional[ArrayLike] = None, dt_bias: Optional[ArrayLike] = None,
    impl: Optional[Impl] = None, chunk_size: Optional[int] = None,
    cp: Optional[CpSpec] = None, precision: Optional[str] = None,
) -> tuple[Any, Optional[Any]]: ...
def naive_recurrent_kda_backward(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, beta: ArrayLike,
    do: ArrayLike, dht: Optional[ArrayLike] = None, *, scale: Optional[float] = None,
    initial_state: Optional[ArrayLike] = None, cu_seqlens: Optional[ArrayLike] = None,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
    safe_gate: bool = False, lower_bound: Optional[float] = None,
    A_log: Optional[ArrayLike] = None, dt_bias: Optional[ArrayLike] = None,
    impl: Optional[Impl] = None, chunk_size: Optional[int] = None,
    cp: Optional[CpSpec] = None, precision: Optional[str] = None,
) -> Results: ...
chunk_kda_backward = naive_recurrent_kda_backward

def naive_recurrent_dplr_delta_rule(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, a: ArrayLike, b: ArrayLike, gk: ArrayLike,
    scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
    output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None, *,
    impl: Optional[Impl] = None, chunk_size: Optional[int] = None,
    cp: Optional[CpSpec] = None, precision: Optional[str] = None,
) -> tuple[Any, Optional[Any]]: ...
def chunk_dplr_delta_rule(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, a: ArrayLike, b: ArrayLike, gk: ArrayLike,
    scale: Optional[float] = None, initial_state: Optional[ArrayLike] = None,
    output_final_state: bool = False, cu_seqlens: Optional[ArrayLike] = None,
    cu_seqlens_cpu: Optional[ArrayLike] = None, safe_gate: bool = False,
    chunk_size: Optional[int] = None, disable_recompute: bool = False, *,
    lower_bound: Optional[float] = None, impl: Optional[Impl] = None,
    cp: Optional[CpSpec] = None, precision: Optional[str] = None,
) -> tuple[Any, Optional[Any]]: ...
def naive_recurrent_dplr_delta_rule_backward(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, a: ArrayLike, b: ArrayLike, gk: ArrayLike,
    do: ArrayLike, dht: Optional[ArrayLike] = None, *, scale: Optional[float] = None,
    initial_state: Optional[ArrayLike] = None, cu_seqlens: Optional[ArrayLike] = None,
    impl: Optional[Impl] = None, chunk_size: Optional[int] = None,
    cp: Optional[CpSpec] = None, precision: Optional[str] = None,
) -> Results: ...
chunk_dplr_delta_rule_backward = naive_recurrent_dplr_delta_rule_backward

def token_shift(
    x: ArrayLike, cu_seqlens: Optional[ArrayLike] = None, cache: Optional[ArrayLike] = None,
    output_cache: bool = False, chunk_indices: Optional[ArrayLike] = None, *,
    cp: Optional[CpSpec] = None,
) -> Any: ...
def token_shift_backward(
    x: ArrayLike, dy: ArrayLike, dfinal_cache: Optional[ArrayLike] = None, *,
    cu_seqlens: Optional[ArrayLike] = None, cache: Optional[ArrayLike] = None,
    cp: Optional[CpSpec] = None,
) -> Results: ...

def norm_ratio(ref: ArrayLike, tri: ArrayLike) -> float: ...
def max_abs(ref: ArrayLike, tri: ArrayLike) -> float: ...
def assert_close(prefix: str, ref: ArrayLike, tri: ArrayLike, ratio: float) -> None: ...

class Case:
    meta: dict[str, Any]
    tensors: dict[str, npt.NDArray[np.float64]]
    dtypes: dict[str, str]
    cu_seqlens: Optional[list[int]]
    path: Optional[str]
    def __init__(
        self, meta: Mapping[str, Any], tensors: Mapping[str, ArrayLike],
        dtypes: Optional[Mapping[str, str]] = None, cu_seqlens: Optional[ArrayLike] = None,
        path: Optional[str] = None,
    ) -> None: ...
    @property
    def op(self) -> str: ...
    @property
    def name(self) -> str: ...
    def __getitem__(self, name: str) -> npt.NDArray[Any]: ...
    def __contains__(self, name: str) -> bool: ...
    def write(self, path: _Path) -> None: ...
    def run(
        self, impl: Impl = "naive", *, chunk_size: Optional[int] = None,
        cp: Optional[CpSpec] = None, precision: Optional[str] = None, compute: str = "f64",
    ) -> Results: ...

def read_case(path: _Path) -> Case: ...
def write_case(case: Case, path: _Path) -> None: ...
def gen(
    op: Literal["kda", "dplr", "token_shift"], shape: Optional[Sequence[int]] = None,
    lengths: Optional[Sequence[int]] = None, seed: int = 0, *,
    gate: Literal["none", "kda", "lowerbound"] = "none", lower_bound: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False, initial_state: bool = False,
    scale: Optional[float] = None, dtype: Literal["f64", "f32", "bf16", "f16"] = "f64",
    expected: bool = False, out: Optional[_Path] = None,
) -> Case: ...

class Report:
    json: str
    case: str
    reference: str
    candidate: str
    max_ratio: float
    rows: list[dict[str, Any]]
    passed: bool
    def __bool__(self) -> bool: ...
    def __getitem__(self, tensor: str) -> dict[str, Any]: ...

def verify(
    case: Union[Case, _Path], candidate: Union[None, _Path, Case, Mapping[str, ArrayLike]] = None, *,
    max_ratio: float = 5e-3, impl: Optional[Impl] = None, chunk_size: Optional[int] = None,
    cp: Optional[CpSpec] = None, precision: Optional[str] = None, compute: Optional[str] = None,
    forward_only: bool = False, allow_partial: bool = False,
) -> Report: ...
