"""Tensor parallelism with sequence parallelism (:mod:`hybrid_model.tensor_parallel`): a tiny model of megatron's
attention ``*``, the dense MLP ``-``, DSv4 MoE ``E`` (the first two hash-routed, the MTP one learned), mHC (n = 4)
and one MTP depth, built at TP=2 from the same seed, gives the TP=1 losses and gradients.

The TP=1 run is the same two gloo processes as DP2 (each the whole model); the TP=2 gradients are gathered into
TP=1 tensors by megatron's stride rule, after the replicated parameters' partial gradients (each rank saw its
sequence shard) were summed over TP as ``finalize_model_grads`` does.

Bounds:

* fp32 (fused linear-CE head: the head input gathered over the sequence): TP only reorders fp32 sums (the
  row-parallel products' two halves, the vocab shards' softmax statistics, the two sequence shards of a replicated
  parameter's gradient): the loss within ``1e-5`` relative, each gradient within ``2e-5·max|g| + 1e-8`` (as the
  parallel matrix of dsv4-train; measured: loss ``5e-7`` absolute at 6.2, gradients ``1e-7`` relative). The
  absolute ``1e-8``: the HyperHead gradients are ``~1e-10``, sums of cancelling terms of the size of the other
  gradients (``<= 0.15`` here), so their reordering error is ``u·0.15 ≈ 1e-8`` absolute, not relative to their own
  size (measured with the unfused head: ``6e-12`` at ``2.5e-10``).
* bf16 (unfused head: megatron's output layer + vocab-parallel cross entropy): the project rule against the TP=1
  fp32 run, with TP=1 bf16 as the same-dtype yardstick: ``max|x_tp2 - x_fp32| <= 2·max|x_tp1 - x_fp32| + atol``
  (:func:`dsv4_testkit.assert_close_to_ref`), for the losses and every gradient.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tp_train_workers import tp_steps

from dsv4_testkit import run_distributed
from dsv4_testkit.tolerance import assert_close_to_ref

PATTERN = "*E-E/*E"
FP32, BF16 = (False, True), (True, False)  # (bf16, fused head)


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_equals_tp1_losses_and_gradients():
    ranks = run_distributed(tp_steps, 2, PATTERN, 7, [FP32, BF16], timeout=900)
    fp32, bf16 = ranks[0][FP32], ranks[0][BF16]
    for case in (FP32, BF16):  # every rank of TP=2 holds the same whole losses and gradients
        for name, g in ranks[0][case][2]["grads"].items():
            assert torch.equal(g, ranks[1][case][2]["grads"][name]), name
    # replicated parameters are marked for the TP gradient sum (norms, mHC, routers, MTP projections)
    assert fp32[1]["marked"] == 0 and fp32[2]["marked"] > 30
    one, two = fp32[1], fp32[2]
    assert torch.allclose(two["loss"], one["loss"], rtol=1e-5, atol=0)
    assert torch.allclose(two["mtp"], one["mtp"], rtol=1e-5, atol=0)
    assert set(two["grads"]) == set(one["grads"])
    for name, g in one["grads"].items():
        err = float((two["grads"][name] - g).abs().max())
        assert err <= 2e-5 * float(g.abs().max()) + 1e-8, (name, err)
    ref, same = fp32[1], bf16[1]  # the TP=1 fp32 reference and its bf16 yardstick
    got = bf16[2]
    assert_close_to_ref("loss", got["loss"], ref["loss"], same["loss"])
    assert_close_to_ref("mtp loss", got["mtp"], ref["mtp"], same["mtp"])
    for name, g in ref["grads"].items():
        assert_close_to_ref(name, got["grads"][name], g, same["grads"][name])
