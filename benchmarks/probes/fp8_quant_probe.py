"""Where do the FP8 forward's pulled x rows differ from kittenmoe.fp8.quantize_activations on a GPU? A probe.

    PYTHONPATH=src python3 benchmarks/probes/fp8_quant_probe.py

Runs the FP8 forward on the small problem of tests/test_megakernel_fp8.py::test_fp8_routed_rows_and_scales_are_
the_quantiser_s, then prints how many e4m3 bytes and scales differ from the torch quantiser and from the Triton
quantiser (impl="triton"), and for the first few differing bytes: the source value, the scale, x / scale in
fp32 and fp64, and the three e4m3 values.
"""

import torch

from kittenmoe.config import KernelConfig, ModelShape
from kittenmoe.fp8 import FP8Config, FP8ExpertWeights, quantize_activations
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.testing import make_weights, routing_uniform

dev = torch.device("cuda")
shape = ModelShape(name="fp8-tiny", e=4, h=256, i=128, k=2)
g = torch.Generator().manual_seed(4)
w = make_weights(shape, dtype=torch.bfloat16, device=dev, generator=g)
x = torch.randn(20, shape.h, generator=g).to(dev, torch.bfloat16)
ids, wts = routing_uniform(20, shape.e, shape.k, generator=g, device=dev)
fp8 = FP8ExpertWeights.quantize(w.w13_E2IH, w.w2_EHI)
for cfg in (KernelConfig(num_comm_programs_fwd=2, minibatch_size=16, block_m=16, block_n=128, block_k=32,
                         num_stages=1, num_warps=4),
            KernelConfig(minibatch_size=256, block_m=64, block_n=128)):
    res = megakernel_forward_multirank([x], [ids], [wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS,
                                       None, config=cfg, fp8=fp8)
    st = res.states[0]
    n = int(st.schedule.num_rows.item())
    rank, tok = st.schedule.peer_rank[:n], st.schedule.peer_token_idx[:n]
    real = rank >= 0
    t = tok[real].long() // shape.k
    got_q, got_s = st.x_routed[:n][real], st.x_scale[:n][real]
    for impl in ("torch", "triton"):
        q, s = quantize_activations(x.float(), FP8Config(), impl=impl)
        want_q, want_s = q.view(torch.uint8)[t], s[t]
        bad = (got_q != want_q).nonzero()
        print(f"block_m {cfg.block_m}: vs {impl}: {len(bad)} of {want_q.numel()} bytes differ, "
              f"{int((got_s != want_s).sum())} of {want_s.numel()} scales differ")
        for r, c in bad[:8].tolist():
            src = x[t[r], c].float()
            sc = got_s[r, c // 128]
            print(f"   row {r} col {c}: x {src.item():.8e} scale {sc.item():.8e} (want {want_s[r, c // 128].item():.8e}) "
                  f"x/s f32 {(src / sc).item():.9e} f64 {(src.double() / sc.double()).item():.12e} "
                  f"kernel {got_q[r, c].item():#04x} -> {got_q[r, c].view(torch.float8_e4m3fn).float().item()} "
                  f"{impl} {want_q[r, c].item():#04x} -> {want_q[r, c].view(torch.float8_e4m3fn).float().item()}")
