"""``--pattern`` / ``--no-mhc`` as model overrides of ``dsv4 train`` and the run-directory rule that refuses a resume
with another pattern or mHC switch. The symbols themselves are tested in hybrid-model's ``test_symbol_layers.py``."""

from dsv4_train.checkpoint import resume_conflicts
from dsv4_train.cli import build_parser, train_config_from_args
from dsv4_train.model_config import model_config_for


def test_cli_flags_become_model_overrides_and_resume_refuses_a_switch_change():
    """--pattern / --no-mhc are model overrides (recorded in the run directory); a resume that flips the mHC switch
    (or changes the pattern) is refused by the run-directory rules."""
    parse = lambda *argv: train_config_from_args(build_parser().parse_args(["train", *argv]))
    tc = parse("--no-mhc", "--pattern", "WECE/WE/WE")
    assert tc.model.model_overrides == {"hybrid_layer_pattern": "WECE/WE/WE", "enable_mhc_connections": False}
    cfg = model_config_for(tc)
    assert not cfg.enable_mhc_connections and cfg.layer_pattern == "WECE/WE/WE"
    assert (cfg.num_layers, cfg.num_nextn_predict_layers, cfg.compress_ratios) == (2, 2, (0, 4, 0, 0))
    with_mhc = parse("--pattern", "WECE/WE/WE")
    conflicts = resume_conflicts(with_mhc, tc.to_dict(), {})
    assert (
        len(conflicts) == 1
        and conflicts[0].startswith("--model-overrides")
        and "enable_mhc_connections" in conflicts[0]
    )
    assert resume_conflicts(tc, tc.to_dict(), {}) == []
