"""fused_adamw_step (Triton; the interpreter on CPU) vs torch.optim.AdamW(foreach=False) over several steps: odd
sizes, many tensors, zero-size tensors, per-group scalars, the clip coefficient, the bf16 model copy, poisoned
outputs, argument errors; bf16 on the GPU.

Tolerance: each step's update may differ from torch's by a few fp32 roundings of its own size (``lr * R``, ``R`` =
``|m_hat| / (sqrt(v_hat) + eps)`` <= 2 for these gradients) plus one ulp of the param, accumulated over the steps
(the module doc of ``dsv4_train.optimizer``); the moments by a few roundings of theirs. The bf16 copy must be the
bitwise rounding of the kernel's own fp32 param (same run)."""

import pytest
import torch

from dsv4_primitives.fused_adamw import AdamWHyper, fused_adamw_ref, fused_adamw_step
from dsv4_testkit import interpreting

needs_triton = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS32 = 2.0**-23
C_ROUNDINGS = 32
GROUPS = (  # (lr, betas, eps, weight_decay); beta1 < 0.5 takes lerp's other branch
    dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    dict(lr=3e-3, betas=(0.3, 0.999), eps=1e-6, weight_decay=0.0),
)


def _hyper(group: dict) -> AdamWHyper:
    return AdamWHyper(group["lr"], *group["betas"], group["eps"], group["weight_decay"])


def _run(sizes, steps, *, grad_dtype=torch.float32, clip=0.5, block=1024, device=DEV):
    """(ours, torch's) final (params, exp_avgs, exp_avg_sqs, bf16 copies) after ``steps`` steps; tensor i in group
    i % 2, gradients fresh per step."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=gen).to(device) for n in sizes]
    ref_params = [p.clone().requires_grad_(True) for p in init]
    groups = [{"params": ref_params[g::2], **GROUPS[g]} for g in range(2)]
    torch_opt = torch.optim.AdamW([g for g in groups if g["params"]], foreach=False, fused=False)
    params = [p.clone() for p in init]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    copies = [torch.full_like(p, float("nan"), dtype=torch.bfloat16) for p in params]
    hypers = [_hyper(GROUPS[i % 2]) for i in range(len(sizes))]
    clip_t = torch.tensor([clip], device=device)
    for step in range(1, steps + 1):
        scale = 10.0 ** (step % 3 - 3)
        grads = [(scale * torch.randn(n, generator=gen)).to(device, grad_dtype) for n in sizes]
        kept = [g.clone() for g in grads]
        for rp, g in zip(ref_params, grads, strict=True):
            rp.grad = g.float() * clip_t  # the clipped gradient, in fp32 as the kernel forms it
        torch_opt.step()
        fused_adamw_step(params, grads, m, v, [step] * len(sizes), hypers, copies, clip_t, block=block)
        assert all(torch.equal(a, b) for a, b in zip(grads, kept, strict=True)), "the kernel wrote a gradient"
    st = [torch_opt.state[p] for p in ref_params]
    ref = ([p.detach() for p in ref_params], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st])
    return (params, m, v, copies), ref


def _assert_within_bound(ours, ref, steps):
    for i, (p, rp) in enumerate(zip(ours[0], ref[0], strict=True)):
        lr = GROUPS[i % 2]["lr"]
        bound = steps * (C_ROUNDINGS * EPS32 * lr * 2.0 + EPS32 * rp.abs())
        assert ((p - rp).abs() <= bound).all(), f"param {i}: max err {(p - rp).abs().max():.3e}"
        for name, a, b in (("exp_avg", ours[1][i], ref[1][i]), ("exp_avg_sq", ours[2][i], ref[2][i])):
            tol = steps * C_ROUNDINGS * EPS32 * b.abs().max().clamp_min(1e-30) if b.numel() else 0.0
            assert (a - b).abs().max() <= tol if a.numel() else True, f"{name} of param {i}"
        # the model copy is the round-to-nearest-even bf16 of the kernel's own param (same run: bitwise)
        assert torch.equal(ours[3][i], p.bfloat16()), f"bf16 copy of param {i}"


@needs_triton
def test_matches_torch_adamw_odd_sizes():
    sizes = [1, 1023, 1024, 1025, 0, 37, 5000]
    ours, ref = _run(sizes, steps=4)
    _assert_within_bound(ours, ref, 4)


@needs_triton
def test_many_tensors_one_launch():
    sizes = [int(n) for n in torch.randint(1, 60, (300,), generator=torch.Generator().manual_seed(1))]
    ours, ref = _run(sizes, steps=2, block=64)
    _assert_within_bound(ours, ref, 2)


@needs_triton
def test_bf16_grads_without_clipping():
    ours, ref = _run([3, 700, 129], steps=3, grad_dtype=torch.bfloat16, clip=1.0, block=128)
    _assert_within_bound(ours, ref, 3)


@needs_triton
def test_matches_reference_and_runs_are_bitwise_repeatable():
    sizes = [5, 2100]
    gen = torch.Generator().manual_seed(3)
    tensors = [[torch.randn(n, generator=gen).to(DEV) for n in sizes] for _ in range(2)]  # params, grads
    hypers = [_hyper(GROUPS[0]), _hyper(GROUPS[1])]
    clip = torch.tensor([0.25], device=DEV)
    outs = []
    for fn in (fused_adamw_step, fused_adamw_step, fused_adamw_ref):
        p = [t.clone() for t in tensors[0]]
        m, v = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
        for step in (1, 2, 3):
            fn(p, tensors[1], m, v, [step, step], hypers, None, clip)
        outs.append((p, m, v))
    for a, b in zip(outs[0], outs[1], strict=True):  # same inputs, same machine: same bits
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for i, (p, rp) in enumerate(zip(outs[0][0], outs[2][0], strict=True)):
        bound = 3 * (C_ROUNDINGS * EPS32 * GROUPS[i]["lr"] * 2.0 + EPS32 * rp.abs())
        assert ((p - rp).abs() <= bound).all(), i


@needs_triton
def test_poisoned_outputs_written_exactly_in_range():
    """Every element of each model copy is written (NaN poison gone) and nothing around it (views of one
    NaN-filled buffer with gaps); main param, moments and grads outside the views untouched too."""
    sizes = [1, 300, 17]
    buf = torch.full((400,), float("nan"), dtype=torch.bfloat16, device=DEV)
    main = torch.full((400,), -7.0, device=DEV)
    offsets = [2, 10, 360]
    copies = [buf[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
    params = [main[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
    for p in params:
        p.normal_()
    grads = [torch.randn(n, device=DEV) for n in sizes]
    m = [torch.zeros(n, device=DEV) for n in sizes]
    v = [torch.zeros(n, device=DEV) for n in sizes]
    fused_adamw_step(params, grads, m, v, [1, 1, 1], [_hyper(GROUPS[0])] * 3, copies, block=64)
    inside = torch.zeros(400, dtype=torch.bool, device=DEV)
    for o, n in zip(offsets, sizes, strict=True):
        inside[o : o + n] = True
    assert torch.isfinite(buf[inside].float()).all()
    assert torch.isnan(buf[~inside].float()).all()
    assert (main[~inside] == -7.0).all()
    for p, c in zip(params, copies, strict=True):
        assert torch.equal(c, p.bfloat16())


@needs_triton
def test_empty_and_zero_size_lists():
    fused_adamw_step([], [], [], [], [], [])
    z = torch.zeros(0, device=DEV)
    fused_adamw_step([z], [z], [z.clone()], [z.clone()], [1], [_hyper(GROUPS[0])], [z.bfloat16()])


@needs_triton
def test_model_copy_aliasing_the_main_param_is_skipped():
    p = torch.randn(50, device=DEV)
    g = torch.randn(50, device=DEV)
    ref = p.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    m2, v2 = torch.zeros_like(p), torch.zeros_like(p)
    fused_adamw_step([p], [g], [m], [v], [1], [_hyper(GROUPS[0])], [p])
    fused_adamw_ref([ref], [g], [m2], [v2], [1], [_hyper(GROUPS[0])])
    assert ((p - ref).abs() <= C_ROUNDINGS * EPS32 * 1e-2 * 2 + EPS32 * ref.abs()).all()


@needs_triton
def test_argument_errors(monkeypatch):
    p, h = torch.zeros(4, device=DEV), _hyper(GROUPS[0])
    args = ([p], [p.clone()], [p.clone()], [p.clone()])
    with pytest.raises(ValueError, match="1 params but 0 steps"):
        fused_adamw_step(*args, [], [h])
    with pytest.raises(ValueError, match=r"grads\[0\] must be a contiguous"):
        fused_adamw_step([p], [torch.zeros(5, device=DEV)], [p.clone()], [p.clone()], [1], [h])
    with pytest.raises(ValueError, match=r"params\[0\] must be a contiguous"):
        fused_adamw_step([p.bfloat16()], *args[1:], [1], [h])
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] must be a contiguous"):
        fused_adamw_step([p], [p.clone()], [torch.zeros(8, device=DEV)[::2]], [p.clone()], [1], [h])
    with pytest.raises(ValueError, match="step must be >= 1"):
        fused_adamw_step(*args, [0], [h])
    with pytest.raises(ValueError, match="block must be a power of two"):
        fused_adamw_step(*args, [1], [h], block=100)
    with pytest.raises(ValueError, match="clip_coef must be a one-element fp32"):
        fused_adamw_step(*args, [1], [h], clip_coef=torch.ones(2, device=DEV))
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            fused_adamw_step(*args, [1], [h])


@pytest.mark.gpu
def test_cuda_bf16_against_torch_adamw():
    sizes = [1, 4095, 4096, 4097, 0, 1 << 20, 333_333]
    ours, ref = _run(sizes, steps=5, grad_dtype=torch.bfloat16, block=4096, device="cuda")
    _assert_within_bound(ours, ref, 5)


@needs_triton
def test_aligned_and_unaligned_launches_agree_bitwise():
    """The same values through the aligned launch (fresh tensors, size a multiple of 8) and the plain one (views
    one element into their buffers) give the same bits."""
    gen = torch.Generator().manual_seed(5)
    n = 2056
    init = [torch.randn(n, generator=gen).to(DEV) for _ in range(2)]  # param, grad
    runs = []
    for shift in (0, 1):
        bufs = [torch.zeros(n + shift, device=DEV) for _ in range(4)]  # param, grad, m, v
        p, g, m, v = (b[shift:] for b in bufs)
        p.copy_(init[0])
        g.copy_(init[1])
        dst = torch.zeros(n + shift, dtype=torch.bfloat16, device=DEV)[shift:]
        for step in (1, 2):
            fused_adamw_step([p], [g], [m], [v], [step], [_hyper(GROUPS[0])], [dst], block=512)
        runs.append((p, m, v, dst))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_aligned_launch_compiles_to_vector_accesses():
    """The alignment hints give 16-byte loads / stores in the sm_90 PTX (compiled without a GPU); the plain launch
    has none (the hints are what make the difference)."""
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from dsv4_primitives.fused_adamw.kernel import adamw_pointer_table_kernel

    sig = {
        "addr_ptr": "*i64",
        "n_tensors": "i32",
        "numel_ptr": "*i64",
        "hyper_ptr": "*fp32",
        "block_tensor_ptr": "*i32",
        "block_start_ptr": "*i64",
        "clip_ptr": "*fp32",
        **dict.fromkeys(("G_DTYPE", "DST_DTYPE", "HAS_DST", "DST_BF16", "ALIGNED", "BLOCK"), "constexpr"),
    }
    # under TRITON_INTERPRET=1 triton.jit gave an interpreted function: compile its Python function itself
    kernel = getattr(adamw_pointer_table_kernel, "fn", adamw_pointer_table_kernel)
    kernel = (
        kernel
        if isinstance(kernel, triton.runtime.jit.JITFunction)
        else triton.runtime.jit.JITFunction(kernel)
    )
    counts = {}
    for aligned in (True, False):
        consts = dict(G_DTYPE=tl.float32, DST_DTYPE=tl.bfloat16, HAS_DST=True, DST_BF16=True, ALIGNED=aligned)
        src = triton.compiler.ASTSource(kernel, sig, constexprs={**consts, "BLOCK": 4096})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        counts[aligned] = (len(re.findall(r"ld\.global\.v4", ptx)), len(re.findall(r"st\.global\.v4", ptx)))
    # per thread 16 elements: 4 fp32 inputs -> 16 vector loads; 3 fp32 outputs + the bf16 copy -> 14 vector stores
    assert counts[True] == (16, 14), counts
    assert counts[False] == (0, 0), counts
