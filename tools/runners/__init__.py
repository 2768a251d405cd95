"""Runners that put other projects' kernels through deltaref.

Each module here exposes

    NAME        the implementation's name in reports
    CONVENTION  how its tensors differ from FLA's (the deltaref convention name)
    why_not(meta, t) -> str | None   why a case cannot run on it (None: it can)
    run(meta, t) -> (dict, str)      FLA-named outputs and gradients (torch
                                     tensors), and what actually served the call

`t` holds the case's tensors on the GPU (torch), `meta` its `case` options.
The runner translates from FLA's convention (the case) into the kernel's and
back, so its results are judged as FLA-convention tensors. `worker.py`
serves any of them over the runner protocol; `tools/conformance.py` runs them
all over a set of cases.
"""
