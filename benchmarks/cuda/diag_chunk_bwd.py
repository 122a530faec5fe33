# Diagnostics for the chunked backward (benchmarks/cuda/run_chunk_bwd.sh runs it from the repository root):
# per-gradient relative errors of kda/gdn_chunk_bwd vs the float64 reference on a few fp32 cases, then a per-kernel
# CUDA profile of one backward at B1 T8192 H16 HV32 (in device call 5 the 60 s limit cut it before the profile).
import sys, torch
sys.path.insert(0, "tests")
from test_cuda_backend import OPS, make_inputs
from ref_delta import rel_err, ref_delta_rule
for fam in ("kda", "gdn"):
    for T, extra in ((65, {}), (200, dict(extreme=True, gate_div=0.1)), (130, dict(K=40, V=30))):
        q, k, v, g, beta = make_inputs(fam, B=1, T=T, H=1, HV=2, dtype=torch.float32, seed=1, **extra)
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        h0 = torch.randn(1, HV, K, V, device="cuda") * 0.5
        dht = torch.randn(1, HV, K, V, device="cuda")
        do = torch.randn_like(v)
        try:
            a = getattr(OPS, f"{fam}_chunk_bwd")(q, k, v, g, beta, 0.1, h0, None, do, dht)
            torch.cuda.synchronize()
        except Exception as e:
            print(fam, T, "ERROR", repr(e)[:300]); continue
        xs = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
        ro, rs = ref_delta_rule(*xs[:5], scale=0.1, initial_state=xs[5])
        gr = torch.autograd.grad((ro * do.cpu().double()).sum() + (rs * dht.cpu().double()).sum(), xs)
        print(fam, T, extra, " ".join(f"{n}={rel_err(r, x.cpu()):.2e}" for n, r, x in zip(("dq","dk","dv","dg","dbeta","dh0"), gr, a)), flush=True)
