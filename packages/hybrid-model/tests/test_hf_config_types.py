"""A wrongly typed ``config.json`` value is one ``ValueError`` naming the file, the key, the expected and the found
JSON type (issue 29: it was a bare ``TypeError``, or a silent ``int("4")``). The accepted spellings (released,
``ModelArgs``, transformers' own ``to_dict``) are covered by test_hf_config.py, which runs through the same check."""

import json

import pytest

from hybrid_model.hf import hf_config_from_model_config, model_config_from_hf, read_official_checkpoint
from hybrid_model.hf.config_types import JsonType, check_hf_config_types, json_kind
from hybrid_model.presets import get_preset


def _tiny() -> dict:
    return hf_config_from_model_config(get_preset("tiny"))


def _with(config: dict, path: str, value) -> dict:
    c = json.loads(json.dumps(config))
    *parents, last = path.split(".")
    node = c
    for p in parents:
        node = node[p]
    node[last] = value
    return c


@pytest.mark.parametrize(
    ("path", "value", "key", "expected", "found"),
    [
        ("num_hidden_layers", "4", "num_hidden_layers", "an integer", "a string ('4')"),
        ("num_hidden_layers", [4], "num_hidden_layers", "an integer", "an array ([4])"),
        (
            "num_hidden_layers",
            4.0,
            "num_hidden_layers",
            "an integer",
            "a number written with a fraction (.0)",
        ),
        ("num_hidden_layers", True, "num_hidden_layers", "an integer", "a boolean (True)"),
        ("hidden_size", "64", "hidden_size", "an integer or null", "a string ('64')"),
        ("rope_theta", None, "rope_theta", "a number", "null (None)"),
        ("hc_eps", "1e-6", "hc_eps", "a number or null", "a string ('1e-6')"),
        ("norm_topk_prob", "true", "norm_topk_prob", "a boolean (true/false) or null", "a string ('true')"),
        ("scoring_func", 3, "scoring_func", "a string or null", "an integer (3)"),
        ("layer_types", "sliding_attention", "layer_types", "an array of strings or null", "a string"),
        ("mlp_layer_types", ["moe", 1], "mlp_layer_types[1]", "a string", "an integer (1)"),
        ("compress_rates", [4, 128], "compress_rates", "an object of integer values or null", "an array"),
        (
            "compress_rates.compressed_sparse_attention",
            "4",
            "compress_rates.compressed_sparse_attention",
            "an integer",
            "a string ('4')",
        ),
        (
            "rope_parameters.compress.factor",
            "4",
            "rope_parameters.compress.factor",
            "a number or null",
            "a string",
        ),
        ("rope_parameters.main", [], "rope_parameters.main", "an object or null", "an array ([])"),
    ],
)
def test_a_wrongly_typed_value_names_the_file_key_and_types(path, value, key, expected, found):
    with pytest.raises(ValueError) as err:
        model_config_from_hf(_with(_tiny(), path, value), source="/ckpt/config.json")
    msg = str(err.value)
    assert msg.startswith(f"/ckpt/config.json: key {key!r} must be {expected}, found {found}"), msg
    assert "\n" not in msg


def test_official_model_args_names_and_released_rope_scaling_are_checked():
    args = {"n_layers": "4", "dim": 64}
    with pytest.raises(ValueError, match="key 'n_layers' must be an integer, found a string"):
        check_hf_config_types(args, "inference/config.json")
    released = {"rope_scaling": {"type": "yarn", "factor": "16", "original_max_position_embeddings": 65536}}
    with pytest.raises(
        ValueError, match=r"key 'rope_scaling\.factor' must be a number or null, found a string"
    ):
        check_hf_config_types(released)
    check_hf_config_types({"compress_ratios": None, "rope_theta": 10000, "unknown_key": [object()]})
    assert str(JsonType("array", JsonType("integer"), nullable=True)) == "an array of integers or null"
    assert json_kind(1.5) == "a number with a fraction" and json_kind({}) == "an object"


def test_loading_a_directory_names_its_config_json_before_reading_any_tensor(tmp_path):
    """The check runs before the weights are read (here there are none) and before any value is used."""
    (tmp_path / "config.json").write_text(json.dumps(_with(_tiny(), "num_nextn_predict_layers", [1])))
    with pytest.raises(ValueError) as err:
        read_official_checkpoint(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / 'config.json'}: key 'num_nextn_predict_layers' must be an integer or null, found an "
        "array ([1])"
    )
