"""The resume-layout refusal (no processes needed: the check reads only a checkpoint's common state)."""

import pytest

from dsv4_train.checkpoint import check_resume_layout


def test_resume_only_at_the_saved_model_layout():
    common = {"model_layout": [2, 1, 1], "rng_layout": [2, 1, 2]}
    check_resume_layout(common, "ckpt", (2, 1, 1))  # the DP size may change: not part of the layout
    for layout in ((1, 1, 1), (2, 1, 2), (4, 1, 1)):
        with pytest.raises(ValueError, match=r"saved at \(PP, TP, EP\) = \(2, 1, 1\).*--init-from"):
            check_resume_layout(common, "ckpt", layout)


def test_checkpoints_without_model_layout_use_the_rng_layout():
    old = {"rng_layout": [2, 1, 4]}  # (PP, TP, DP) of checkpoints written before model_layout
    check_resume_layout(old, "ckpt", (2, 1, 1))
    check_resume_layout(old, "ckpt", (2, 1, 2))  # EP unknown there: megatron's own load checks it
    with pytest.raises(ValueError, match=r"\(PP, TP, EP\) = \(2, 1, 1\)"):
        check_resume_layout(old, "ckpt", (1, 1, 1))


def test_fully_reshardable_checkpoints_resume_at_another_pp_or_tp_size():
    common = {"model_layout": [2, 1, 2], "rng_layout": [2, 1, 1], "distopt_format": "fully_reshardable"}
    for layout in ((1, 1, 2), (2, 1, 2), (4, 1, 2), (1, 2, 2), (2, 4, 2)):
        check_resume_layout(common, "ckpt", layout)
    with pytest.raises(
        ValueError, match=r"fully_reshardable\) resumes at another PP, TP or DP size, not at another EP"
    ):
        check_resume_layout(common, "ckpt", (2, 1, 1))
    dp_only = dict(common, distopt_format="dp_reshardable")
    for layout in ((1, 1, 2), (2, 2, 2)):
        with pytest.raises(
            ValueError, match="--ckpt-format fully_reshardable to resume at another PP or TP size"
        ):
            check_resume_layout(dp_only, "ckpt", layout)
