"""Qwen3-8B's QK-norm at 32k on the GPU, timed apart (docs/PERFORMANCE.md, "Model families"): the q and k RMSNorm
kernels of one layer as the model calls them (kernels.rms_norm over head_dim of the q and k projections' outputs):
forward twice (the forward and the recompute) and backward, their CUDA time summed from the profiler, times the
36 layers."""
import torch

import kernels

torch.manual_seed(0)
TOKENS, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32768, 32, 8, 128, 36
q_proj_out = torch.randn(1, TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
k_proj_out = torch.randn(1, TOKENS, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
weight = torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16)


def one_layer():
    q, k = q_proj_out.detach().requires_grad_(), k_proj_out.detach().requires_grad_()
    with torch.no_grad():
        kernels.rms_norm(q, weight, 1e-6)
        kernels.rms_norm(k, weight, 1e-6)
    qn, kn = kernels.rms_norm(q, weight, 1e-6), kernels.rms_norm(k, weight, 1e-6)
    torch.autograd.backward((qn, kn), (torch.ones_like(qn), torch.ones_like(kn)))


for _ in range(5):
    one_layer()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        one_layer()
    torch.cuda.synchronize()
norm_ms = {e.key: e.device_time_total / 20 / 1e3 for e in prof.key_averages() if "norm" in e.key}
for name, ms in norm_ms.items():
    print(f"{name}: {ms:.3f} ms a layer")
print(f"qk-norm kernels {sum(norm_ms.values()):.3f} ms a layer, {sum(norm_ms.values()) * LAYERS:.1f} ms for 36 layers")
