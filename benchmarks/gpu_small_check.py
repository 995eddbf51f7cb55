import torch, time
from kittenmoe.config import TEST_SHAPES, KernelConfig
from kittenmoe.testing import *
from kittenmoe.reference import moe_reference_multirank
from kittenmoe.ops import megakernel_forward_multirank
g = torch.Generator().manual_seed(0)
sh = TEST_SHAPES['small']
dev='cuda'
for dt in (torch.float32, torch.bfloat16):
  for R, mac, T in ((1,None,7),(2,None,100),(2,128,300),(4,128,1000)):
    W = make_weights(sh, generator=g, dtype=dt, device=dev)
    xs = [torch.randn(T, sh.h, generator=g).to(dev, dt) for _ in range(R)]
    rt = [routing_uniform(T, sh.e, sh.k, generator=g, device=dev) for _ in range(R)]
    ids = [a for a,b in rt]; ws = [b for a,b in rt]
    cfg = KernelConfig(num_comm_programs_fwd=4, minibatch_size=128, macrobatch_size=mac, block_m=64, block_n=64, block_k=64, num_warps=4)
    t0=time.time()
    res = megakernel_forward_multirank(xs, ids, ws, W.w13_E2IH, W.w2_EHI, W.shared_w13_2SH, W.shared_w2_HS, 1.0, config=cfg)
    res.check_errors()
    ref = moe_reference_multirank(xs, ids, ws, W.w13_E2IH, W.w2_EHI, W.shared_w13_2SH, W.shared_w2_HS, 1.0)
    print(dt, R, mac, T, [f"{rel_l1(o, r):.2e}" for o, r in zip(res.outputs, ref)], f"{time.time()-t0:.1f}s", flush=True)
