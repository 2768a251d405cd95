"""Bad inputs raise ValueError with the CLI's message, never crash."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import deltaref
from conftest import FIXTURES


def kda_small() -> deltaref.Case:
    return deltaref.read_case(next(p for p in FIXTURES if p.stem == "kda_small"))


def cli_error(cli, *args) -> str:
    p = cli(*args)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.startswith("error: ")
    return p.stderr[len("error: "):].rstrip("\n")


@pytest.mark.parametrize(
    "name,edit",
    [
        ("k", lambda x: x[:, :5]),
        ("beta", lambda x: x[..., None]),
        ("initial_state", lambda x: x[:1]),
        ("v", lambda x: np.where(np.arange(x.size).reshape(x.shape) == 7, np.nan, x)),
    ],
)
def test_bad_tensor_gives_the_cli_message(name, edit, cli, tmp_path):
    case = kda_small()
    t = dict(case.tensors)
    t[name] = edit(t[name])
    bad = deltaref.Case(case.meta, t, case.dtypes)
    path = tmp_path / "bad.safetensors"
    bad.write(path)
    want = cli_error(cli, "run", "--case", path)
    with pytest.raises(ValueError) as e:
        deltaref.read_case(path)
    assert str(e.value) == want
    with pytest.raises(ValueError) as e:
        deltaref.naive_recurrent_kda_backward(
            t["q"], t["k"], t["v"], t["g"], t["beta"], t["do"], t["dht"],
            initial_state=t["initial_state"],
        )
    assert want == f"{path}: {e.value}"


def test_bad_cu_seqlens_gives_the_cli_message(cli, tmp_path):
    case = deltaref.read_case(next(p for p in FIXTURES if p.stem == "kda_varlen_0_1"))
    cu = list(case.cu_seqlens)
    cu[-1] += 3
    path = tmp_path / "bad.safetensors"
    deltaref.Case(case.meta, case.tensors, case.dtypes, cu).write(path)
    want = cli_error(cli, "run", "--case", path)
    t = case.tensors
    with pytest.raises(ValueError) as e:
        deltaref.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=np.array(cu))
    assert want == f"{path}: {e.value}"
    assert "cu_seqlens" in str(e.value)


@pytest.mark.parametrize(
    "flags,kw",
    [
        (["--impl", "fast"], dict(impl="fast")),
        (["--impl", "chunk", "--chunk-size", "48"], dict(impl="chunk", chunk_size=48)),
        (["--impl", "cp"], dict(impl="cp")),
        (["--impl", "cp", "--world", "2", "--cp-engine", "fast"],
         dict(impl="cp", cp={"world": 2, "engine": "fast"})),
        (["--precision", "bf17"], dict(precision="bf17")),
        (["--impl", "chunk", "--precision", "drop-merged-state"],
         dict(impl="chunk", precision="drop-merged-state")),
    ],
)
def test_bad_implementation_gives_the_cli_message(flags, kw, cli):
    path = next(p for p in FIXTURES if p.stem == "kda_small")
    want = cli_error(cli, "run", "--case", path, *flags)
    with pytest.raises(ValueError) as e:
        deltaref.read_case(path).run(**kw)
    if "--chunk-size" in flags:
        # clap checks the flag before the case is read and words it its own
        # way; both name the value and the allowed sizes.
        for part in ("48", "16, 32 or 64"):
            assert part in str(e.value) and part in want
    elif kw.get("impl") == "fast":
        # `--impl` is typed: clap wraps the name's own message, which the
        # binding gives alone.
        assert str(e.value).startswith("unknown --impl `fast` (available: naive, chunk, cp")
        assert str(e.value) in want
    elif "--cp-engine" in flags:
        # clap lists a ValueEnum's values its own way; both name the flag,
        # the value and the engines.
        assert str(e.value) == "unknown --cp-engine `fast` (available: naive, chunk)"
        for part in ("--cp-engine", "fast", "naive", "chunk"):
            assert part in want
    else:
        assert str(e.value) == want


def test_unreadable_files_give_the_cli_message(cli, tmp_path):
    src = next(p for p in FIXTURES if p.stem == "kda_small").read_bytes()
    for i, data in enumerate([b"", src[:100], b"\xff" * 64, src[: len(src) // 2]]):
        path = tmp_path / f"broken{i}.safetensors"
        path.write_bytes(data)
        want = cli_error(cli, "run", "--case", path)
        with pytest.raises(ValueError) as e:
            deltaref.read_case(path)
        assert str(e.value) == want
    with pytest.raises(ValueError, match="cannot read"):
        deltaref.read_case(tmp_path / "missing.safetensors")


def test_python_side_refusals():
    t = kda_small().tensors
    q, k, v, g, beta = (t[n] for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match="tensor `q`: dtype int64"):
        deltaref.chunk_kda(q.astype(np.int64), k, v, g, beta)
    with pytest.raises(ValueError, match="tensor `k`: dtype float16"):
        deltaref.chunk_kda(q, k.astype(np.float16), v, g, beta)
    with pytest.raises(ValueError, match="use_gate_in_kernel=True"):
        deltaref.chunk_kda(q, k, v, g, beta, A_log=np.zeros(2))
    with pytest.raises(ValueError, match="`A_log` must be provided"):
        deltaref.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="return_intermediate_states and state_v_first"):
        deltaref.chunk_kda(q, k, v, g, beta, state_v_first=True)
    with pytest.raises(ValueError, match=r"cp: unknown key\(s\) \['ranks'\]"):
        deltaref.chunk_kda(q, k, v, g, beta, cp={"ranks": 2})
    with pytest.raises(ValueError, match="--layout: .*unknown CP layout `ring`"):
        deltaref.chunk_kda(q, k, v, g, beta, cp={"world": 1, "layout": "ring"})
    with pytest.raises(ValueError, match="1-D integer array"):
        deltaref.chunk_kda(q, k, v, g, beta, cu_seqlens=np.array([0.0, 24.0]))
    with pytest.raises(ValueError, match="not a float tensor of op kda"):
        deltaref.Case({"op": "kda"}, {"qq": q}).write("/nonexistent/x.safetensors")
    with pytest.raises(ValueError, match="metadata: key `op`"):
        deltaref.Case({"op": "mamba2"}, {"q": q}).run()
    with pytest.raises(ValueError, match="shapes differ"):
        deltaref.norm_ratio(q, k[:, :3])
    with pytest.raises(ValueError, match="stores no expected outputs"):
        deltaref.verify(deltaref.gen("kda", shape=[1, 8, 1, 1, 4, 4]))


def test_verify_refuses_impl_flags_with_a_candidate(cli, tmp_path):
    path = next(p for p in FIXTURES if p.stem == "kda_small")
    want = cli_error(cli, "verify", "--case", path, "--candidate", path, "--impl", "chunk")
    with pytest.raises(ValueError) as e:
        deltaref.verify(path, str(path), impl="chunk")
    assert str(e.value) == want


def test_long_calls_release_the_gil():
    case = deltaref.gen("kda", shape=[1, 8192, 4, 4, 64, 64], use_qk_l2norm_in_kernel=True)
    t = case.tensors
    done = threading.Event()
    seconds = []

    def work():
        start = time.perf_counter()
        deltaref.naive_recurrent_kda_backward(
            t["q"], t["k"], t["v"], t["g"], t["beta"], t["do"], use_qk_l2norm_in_kernel=True
        )
        seconds.append(time.perf_counter() - start)
        done.set()

    worker = threading.Thread(target=work)
    ticks = 0
    worker.start()
    while not done.is_set():
        time.sleep(0.001)  # needs the GIL back after every sleep
        ticks += 1
    worker.join()
    # Holding the GIL for the whole call would leave the loop at ~1 tick;
    # released, it ticks about once a millisecond.
    assert seconds[0] > 0.05, f"the call took {seconds[0]:.3f} s: too short to tell"
    assert ticks >= 20, (ticks, seconds)


def test_no_panic_reaches_python():
    # Shape arithmetic on absurd sizes: a clean ValueError whatever the Rust
    # side does with it (validation error, or a caught panic).
    with pytest.raises(ValueError):
        deltaref.gen("kda", shape=[1, 2**64 - 1, 1, 1, 1, 1])
    with pytest.raises(ValueError):
        deltaref.gen("kda", lengths=[2**63, 2**63])


def test_precisions_are_exactly_the_preset_names():
    """``deltaref.PRECISIONS`` lists the preset names and nothing else (no
    prose from the CLI's error message)."""
    import re

    assert "exact" in deltaref.PRECISIONS and "fla-bf16" in deltaref.PRECISIONS
    for p in deltaref.PRECISIONS:
        assert re.fullmatch(r"[a-z0-9-]+", p), p

