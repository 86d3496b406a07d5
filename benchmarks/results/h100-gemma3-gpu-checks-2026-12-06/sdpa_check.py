"""StaticLM's causal prefill attention in bf16 on the GPU against a float64 reference, by head shape (Gemma 3
270M's 4 query heads to 1 KV head, 256 wide; SmolLM2's 9 to 3, 64 wide; two more) and prompt length."""
import torch
import torch.nn.functional as F

from dflash_train.decode.static_lm import causal_attention

torch.manual_seed(0)
dev = "cuda"
for H, Hkv, d in ((4, 1, 256), (9, 3, 64), (4, 1, 128), (8, 8, 256)):
    for L in (32, 64, 65, 100, 128, 200, 424):
        q = torch.randn(1, H, L, d, device=dev)
        k, v = (torch.randn(1, Hkv, L, d, device=dev) for _ in range(2))
        kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        ref = F.scaled_dot_product_attention(q.double(), kr.double(), vr.double(), is_causal=True, scale=d**-0.5)
        ours = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), d**-0.5).float()
        err = float((ours - ref.float()).abs().max())
        print(f"H={H} Hkv={Hkv} d={d} L={L}: causal_attention bf16 max err {err:.4f}", "BAD" if err > 0.05 else "")
