"""The package and the CLI are one program: same bits, same tables, same files."""

from __future__ import annotations

import pytest

import deltaref
from conftest import FIXTURES, FUNCTION_FIXTURES, backward_of, fla_kwargs, same_bits

IDS = [p.stem for p in FIXTURES]
FUNCTION_IDS = [p.stem for p in FUNCTION_FIXTURES]


def test_fixtures_are_there():
    assert len(FIXTURES) >= 10, "the committed fixtures/ directory is missing or empty"


@pytest.mark.parametrize("path", FUNCTION_FIXTURES, ids=FUNCTION_IDS)
def test_naive_reproduces_the_stored_truth_bit_for_bit(path):
    # The fixtures' truth was written by the CLI (naive engine, f64).
    case = deltaref.read_case(path)
    stored = {n: case.tensors[n] for n in case.tensors if n in _results(case.op)}
    assert stored, f"{path.name} stores no truth"
    got = backward_of(case, "naive")
    assert set(got) == set(stored)
    for name, want in stored.items():
        assert same_bits(got[name], want), name


@pytest.mark.parametrize("path", FUNCTION_FIXTURES, ids=FUNCTION_IDS)
def test_chunk_and_cp_match_deltaref_run_bit_for_bit(path, cli, tmp_path):
    case = deltaref.read_case(path)
    runs = [("chunk", {})]
    if "cp" in case.meta:
        runs.append(("cp", {"cp": case.meta["cp"]}))
    for impl, extra in runs:
        out = tmp_path / f"{impl}.safetensors"
        p = cli("run", "--case", path, "--impl", impl, "--out", out)
        assert p.returncode == 0, p.stderr
        want = deltaref.read_case(out)
        got = backward_of(case, "chunk", chunk_size=case.meta.get("chunk_size"), **extra)
        if case.op != "token_shift":  # no engine: the CLI names the flag, runs naive
            # The CLI's header names the implementation, then its precision
            # and compute dtype: `impl:chunk(C=64) [precision exact, compute f64] on …`.
            assert p.stdout.startswith(f"impl:{got.impl} [precision exact, compute f64] on ")
        for name in got:
            assert same_bits(got[name], want.tensors[name]), f"{impl}: {name}"
        # The forward-only path gives the same outputs.
        fwd = backward_of(case, "chunk", upstream=False, chunk_size=case.meta.get("chunk_size"), **extra)
        assert len(fwd) == 2
        for name in fwd:
            assert same_bits(fwd[name], want.tensors[name]), f"{impl} forward: {name}"


@pytest.mark.parametrize("path", FUNCTION_FIXTURES[:6], ids=FUNCTION_IDS[:6])
def test_forward_functions_match_the_truth(path):
    case = deltaref.read_case(path)
    t, kw = case.tensors, fla_kwargs(case)
    if case.op == "token_shift":
        y, last = deltaref.token_shift(
            t["x"], kw.get("cu_seqlens"), t.get("cache"), output_cache=True
        )
        assert same_bits(y, t["y"]) and same_bits(last, t["final_cache"])
        return
    if case.op == "kda":
        o, ht = deltaref.naive_recurrent_kda(
            t["q"], t["k"], t["v"], t["g"], t["beta"], output_final_state=True, **kw
        )
    else:
        o, ht = deltaref.naive_recurrent_dplr_delta_rule(
            t["q"], t["k"], t["v"], t["a"], t["b"], t["gk"], output_final_state=True, **kw
        )
    assert same_bits(o, t["o"]) and same_bits(ht, t["final_state"])


@pytest.mark.parametrize(
    "name,impl",
    [("kda_small", "chunk"), ("cp_kda_400_624_world2", "cp"), ("token_shift_varlen_cache", "naive")],
)
def test_verify_prints_the_cli_table(name, impl, cli):
    path = next(p for p in FIXTURES if p.stem == name)
    p = cli("verify", "--case", path, "--impl", impl)
    report = deltaref.verify(str(path), impl=impl)
    assert p.stdout == str(report) + "\n"
    assert p.returncode == (0 if report.passed else 1)
    assert report.rows and report.passed == all(r["pass"] for r in report.rows)


def test_verify_a_candidate_file_like_the_cli(cli, tmp_path):
    path = next(p for p in FIXTURES if p.stem == "kda_small")
    cand = tmp_path / "cand.safetensors"
    assert cli("run", "--case", path, "--impl", "chunk", "--compute", "f32", "--out", cand).returncode == 0
    p = cli("verify", "--case", path, "--candidate", cand, "--max-ratio", "1e-9")
    report = deltaref.verify(str(path), str(cand), max_ratio=1e-9)
    assert p.stdout == str(report) + "\n"
    assert not report and p.returncode == 1
    assert report["o"]["norm_ratio"] > 1e-9


@pytest.mark.parametrize(
    "args,kw",
    [
        (["--op", "kda", "--seed", "3", "--l2norm", "--gate", "kda", "--initial-state"],
         dict(op="kda", seed=3, use_qk_l2norm_in_kernel=True, gate="kda", initial_state=True)),
        (["--op", "dplr", "--lengths", "5,0,17", "--dtype", "bf16", "--expected"],
         dict(op="dplr", lengths=[5, 0, 17], dtype="bf16", expected=True)),
        (["--op", "token_shift", "--shape", "2,9,4", "--initial-state", "--expected"],
         dict(op="token_shift", shape=[2, 9, 4], initial_state=True, expected=True)),
    ],
)
def test_gen_writes_the_cli_bytes(args, kw, cli, tmp_path):
    a, b = tmp_path / "cli.safetensors", tmp_path / "py.safetensors"
    assert cli("gen", *args, "--out", a).returncode == 0
    case = deltaref.gen(**kw, out=b)
    assert a.read_bytes() == b.read_bytes()
    again = tmp_path / "again.safetensors"
    deltaref.read_case(b).write(again)
    assert again.read_bytes() == b.read_bytes()
    assert case.path == str(b)


def _results(op):
    return {
        "kda": {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"},
        "dplr": {"o", "final_state", "dq", "dk", "dv", "da", "db", "dgk", "dh0"},
        "token_shift": {"y", "final_cache", "dx", "dcache"},
    }[op]
