"""Step-by-step launch of the sparse attention kernels with a sync after each (locates device faults)."""

import sys

import torch

from csa_kernels.ops.sparse_attn import triton as K

S, H, D = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
fs = int(sys.argv[4]) if len(sys.argv) > 4 else 2
bn = int(sys.argv[5]) if len(sys.argv) > 5 else 16
torch.manual_seed(0)
T = S
kv = torch.randn(T + T // 4, D, device="cuda", dtype=torch.bfloat16)
q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
sink = torch.randn(H, device="cuda")
idx = torch.randint(-1, T + T // 4, (T, 64), device="cuda", dtype=torch.int32)
K.FWD_CONFIG_OVERRIDE = (64, 32, 8, fs)
K.BWD_CONFIG_OVERRIDE = (64, bn, 8, 1)
idx_c, cnt = K.compact_indices(idx)
torch.cuda.synchronize()
print("compact ok", flush=True)
o, lse = K.sparse_attn_fwd(q, kv, sink, idx_c, cnt, D**-0.5)
torch.cuda.synchronize()
print("fwd ok", float(o.float().abs().sum()), flush=True)
do = torch.randn_like(q)
dq, dkv, ds = K.sparse_attn_bwd(q, kv, sink, idx_c, cnt, D**-0.5, o, lse, do)
torch.cuda.synchronize()
print("bwd ok", float(dq.float().abs().sum()), float(dkv.float().abs().sum()), flush=True)
