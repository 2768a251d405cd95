# FLA's chunk_kda (Triton, GPU, bf16) against deltaref's float64 oracle: outputs and every gradient.
import torch
import torch.nn.functional as F
from fla.ops.kda import chunk_kda

import deltaref


def test_fla_chunk_kda_against_the_oracle():
    torch.manual_seed(0)
    B, T, H, K, V = 2, 300, 4, 64, 64
    x = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
             g=F.logsigmoid(torch.randn(B, T, H, K)), beta=torch.rand(B, T, H))
    x = {n: t.bfloat16() for n, t in x.items()} | {"initial_state": torch.randn(B, H, K, V)}
    do, dht = torch.randn(B, T, H, V).bfloat16(), torch.randn(B, H, K, V)   # h0, dht: fp32 (FLA)
    tri = {n: t.cuda().requires_grad_() for n, t in x.items()}
    o, ht = chunk_kda(**tri, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ((o.float() * do.cuda().float()).sum() + (ht * dht.cuda()).sum()).backward()
    # The oracle on exactly the values FLA saw, in float64.
    ref = deltaref.chunk_kda_backward(**{n: t.double() for n, t in x.items()}, do=do.double(),
                                      dht=dht.double(), use_qk_l2norm_in_kernel=True)
    got = {"o": o, "final_state": ht} | {
        {"initial_state": "dh0"}.get(n, "d" + n): t.grad for n, t in tri.items()}
    for name, t in got.items():
        print(f"{name:12} norm_ratio {deltaref.norm_ratio(ref[name], t):.2e}")
        deltaref.assert_close(name, ref[name], t, 8e-3)   # FLA's bar for its bf16 CP tests
