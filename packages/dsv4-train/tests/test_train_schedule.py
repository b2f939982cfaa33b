"""LR decay styles and the MTP loss-weight schedule (spec §8: 0.3, then 0.1 from the start of the LR decay)."""

import pytest

from dsv4_train.config import TrainConfig


def test_cosine_decay_starts_after_warmup():
    tc = TrainConfig.from_flat(steps=30, warmup_steps=5)
    assert tc.lr_decay_start() == 6
    assert [tc.mtp_weight_at(s, 0.3) for s in (0, 5, 6, 29)] == [0.3, 0.3, 0.1, 0.1]
    assert {tc.mtp_weight_at(s, 0.0) for s in range(30)} == {0.0}  # MTP switched off by weight stays off


def test_wsd_decay_starts_before_the_anneal():
    tc = TrainConfig.from_flat(steps=100, warmup_steps=10, lr_decay_style="wsd", lr_wsd_decay_steps=20)
    assert tc.lr_decay_start() == 81
    assert [tc.mtp_weight_at(s, 0.3) for s in (0, 80, 81, 99)] == [0.3, 0.3, 0.1, 0.1]
    # an anneal longer than the run after warm-up still starts after warm-up
    assert (
        TrainConfig.from_flat(
            steps=20, warmup_steps=10, lr_decay_style="wsd", lr_wsd_decay_steps=20
        ).lr_decay_start()
        == 11
    )


def test_constant_mtp_weight_when_disabled():
    tc = TrainConfig.from_flat(steps=10, warmup_steps=2, mtp_loss_weight_decay=None)
    assert {tc.mtp_weight_at(s, 0.3) for s in range(10)} == {0.3}


def test_megatron_scheduler_agrees_with_lr_decay_start():
    """The step that TrainConfig calls the decay start is the first step below the peak LR in megatron's
    scheduler (the one before it is still at the peak)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class _Opt:
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    for kw in (
        dict(steps=30, warmup_steps=5),
        dict(steps=40, warmup_steps=4, lr_decay_style="wsd", lr_wsd_decay_steps=10),
    ):
        tc = TrainConfig.from_flat(**kw)
        sched = OptimizerParamScheduler(
            _Opt(),
            init_lr=0.0,
            max_lr=1.0,
            min_lr=0.1,
            lr_warmup_steps=tc.optimizer.warmup_steps,
            lr_decay_steps=tc.schedule.steps,
            lr_decay_style="WSD" if tc.optimizer.lr_decay_style == "wsd" else "cosine",
            wsd_decay_steps=tc.optimizer.lr_wsd_decay_steps if tc.optimizer.lr_decay_style == "wsd" else None,
            lr_wsd_decay_style="cosine" if tc.optimizer.lr_decay_style == "wsd" else None,
            start_wd=0.0,
            end_wd=0.0,
            wd_incr_steps=tc.schedule.steps,
            wd_incr_style="constant",
        )
        lrs = []
        for s in range(tc.schedule.steps):
            sched.num_steps = s
            lrs.append(sched.get_lr(_Opt.param_groups[0]))
        start = tc.lr_decay_start()
        assert lrs[start - 1] == pytest.approx(1.0) and lrs[start] < 1.0, (kw, lrs)
        assert all(lr < 1.0 for lr in lrs[start:])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(lr_decay_style="linear"), "lr-decay-style"),
        (dict(lr_decay_style="wsd"), "lr-wsd-decay-steps"),
        (dict(lr_decay_style="wsd", lr_wsd_decay_steps=500, steps=100), "lr-wsd-decay-steps"),
        (dict(mtp_loss_weight_decay=-0.1), "mtp-loss-weight-decay"),
        (dict(lr_wsd_decay_steps=5), "only applies to --lr-decay-style wsd"),
    ],
)
def test_schedule_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flat(**kw)


def test_cli_schedule_and_save_final_flags_reach_the_config():
    """`dsv4 train` flags map 1:1 onto TrainConfig fields (through the function `_cmd_train` uses)."""
    from dsv4_train.cli import build_parser, train_config_from_args

    args = build_parser().parse_args(
        [
            "train",
            "--lr-decay-style",
            "wsd",
            "--lr-wsd-decay-steps",
            "5",
            "--mtp-loss-weight-decay",
            "0.2",
            "--no-save-final",
            "--steps",
            "20",
        ]
    )
    tc = train_config_from_args(args)
    assert (
        tc.optimizer.lr_decay_style,
        tc.optimizer.lr_wsd_decay_steps,
        tc.loss.mtp_loss_weight_decay,
        tc.checkpoint.save_final,
    ) == (
        "wsd",
        5,
        0.2,
        False,
    )
    assert tc.lr_decay_start() == 16 and tc.mtp_weight_at(16, 0.3) == 0.2
    defaults = build_parser().parse_args(["train"])
    assert (
        defaults.save_final is None and defaults.lr_decay_style is None
    )  # unset flags keep TrainConfig's defaults
    assert TrainConfig.from_flat().checkpoint.save_final is True
