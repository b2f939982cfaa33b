"""One record per pattern symbol (:mod:`hybrid_model.mixers`): every symbol of the grammar has one, and every refusal,
dependency and count a record holds is what the code raises and counts."""

import importlib.util
import re
import types

import pytest
import torch

from hybrid_model.latent_attention import LatentAttentionLayer
from hybrid_model.mixers.gdn import check_gdn_training
from hybrid_model.mixers.record import Layout, SymbolRecord
from hybrid_model.mixers.registry import (
    REGISTRY,
    check_packed_graph_pattern,
    counted_symbols,
    record,
    require_symbol_dependencies,
    require_symbol_device,
    symbols_refusing,
)
from hybrid_model.standard_attention import CausalSoftmaxAttention
from hybrid_model.symbols import KIND_NAMES, LAYER_SYMBOLS, SEQUENCE_MIXERS
from hybrid_model.tensor_parallel import check_tensor_parallel_pattern

REFUSALS = [(s, r.layout) for s, rec in REGISTRY.items() for r in rec.refusals]
DEPENDENCIES = [(s, dep) for s, rec in REGISTRY.items() for dep in rec.dependencies]


def _pg(cp: int):
    return types.SimpleNamespace(cp=types.SimpleNamespace(size=lambda: cp))


def _config(tp: int = 1):
    return types.SimpleNamespace(tensor_model_parallel_size=tp, kv_channels=8)


def test_every_symbol_of_the_grammar_has_one_record():
    assert set(REGISTRY) == LAYER_SYMBOLS == set(KIND_NAMES)
    assert SEQUENCE_MIXERS < LAYER_SYMBOLS
    for symbol, rec in REGISTRY.items():
        assert isinstance(rec, SymbolRecord) and rec.symbol == symbol and record(symbol) is rec
        assert callable(rec.spec) and rec.layer
    with pytest.raises(ValueError, match=re.escape("'|' is not a layer symbol")):
        record("|")


def test_counted_symbols_are_listed_in_the_messages_order():
    assert counted_symbols("params") == counted_symbols("flops") == "C H W E - * + D G"
    assert [s for s, r in REGISTRY.items() if r.core_flops is not None] == ["C", "H", "W", "*", "+", "D"]


def _raise_refusal(monkeypatch, symbol: str, layout: Layout) -> None:
    """Run the check (or build the layer) that refuses ``layout`` for ``symbol``."""
    rec = REGISTRY[symbol]
    if layout is Layout.CP and symbol == "*":  # the causal core refuses it itself
        CausalSoftmaxAttention(_config(), 1, pg_collection=_pg(2))
    elif layout is Layout.CP:
        rec.check_single_rank(_config(), _pg(2))
    elif layout is Layout.TP:
        rec.check_single_rank(_config(tp=2), _pg(1))
    elif layout is Layout.CPU:
        if torch.cuda.is_available():
            pytest.skip("the refusal of a machine without CUDA")
        require_symbol_device("W" + symbol)
    elif layout is Layout.PACKED:  # G on megatron's torch rule (--deterministic), fla installed
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda n, *a: object() if n == "fla" else real(n, *a)
        )
        check_gdn_training(f"W{symbol}E", packed=True, deterministic=True)
    elif layout is Layout.CUDA_GRAPH:
        check_gdn_training(f"W{symbol}E", packed=False, deterministic=False, cuda_graph=True)
    elif layout is Layout.PACKED_CUDA_GRAPH:
        check_packed_graph_pattern(f"{symbol}E")
    else:
        raise AssertionError(f"no check raises {layout}: add one here")


@pytest.mark.parametrize("symbol, layout", REFUSALS, ids=[f"{s}-{lay.name}" for s, lay in REFUSALS])
def test_each_refusal_raises_the_records_reason(monkeypatch, symbol, layout):
    reason = REGISTRY[symbol].refusal(layout).reason.format(why="--deterministic")
    with pytest.raises(ValueError) as info:
        _raise_refusal(monkeypatch, symbol, layout)
    assert reason in str(info.value)
    if layout in (Layout.CP, Layout.TP, Layout.CPU) and symbol != "*":
        assert str(info.value) == REGISTRY[symbol].message(layout)


def test_supported_layouts_are_not_refused():
    for symbol in "E-":
        assert not REGISTRY[symbol].refusals
        REGISTRY[symbol].check_single_rank(_config(tp=2), _pg(2))
    for symbol in "WCH":  # DSv4 attention: context and tensor parallelism (the adapter splits its heads)
        assert not REGISTRY[symbol].refusals
        REGISTRY[symbol].check_single_rank(_config(tp=2), _pg(2))
    REGISTRY["*"].check_single_rank(_config(tp=2), _pg(1))
    assert symbols_refusing(Layout.CP) >= {"+", "D", "G"}
    assert symbols_refusing(Layout.TP) == {"+", "D", "G"}
    check_gdn_training("WCE-", packed=True, deterministic=True, cuda_graph=True)
    check_packed_graph_pattern("WCHE-")


def test_the_pattern_check_raises_unconditional_tp_refusals_only():
    check_tensor_parallel_pattern("*E-/*E", 2)
    check_tensor_parallel_pattern("WCHE", 2)
    check_tensor_parallel_pattern("+D-", 2)  # the local spec's refusal: raised when the layer is built
    with pytest.raises(ValueError) as info:
        check_tensor_parallel_pattern("*EG", 4)
    assert str(info.value) == "--tp 4: " + REGISTRY["G"].message(Layout.TP)


def test_the_local_latent_layer_refuses_before_it_builds():
    for symbol in "+D":
        with pytest.raises(ValueError, match=re.escape(REGISTRY[symbol].message(Layout.CP))):
            LatentAttentionLayer(_config(), None, record=REGISTRY[symbol], local=True, pg_collection=_pg(2))


@pytest.mark.parametrize("symbol, dependency", DEPENDENCIES, ids=[f"{s}-{d.module}" for s, d in DEPENDENCIES])
def test_each_dependency_is_named_when_missing(monkeypatch, symbol, dependency):
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == dependency.module else object()
    )
    assert REGISTRY[symbol].missing_packages() == [dependency.package]
    with pytest.raises(
        ImportError, match=re.escape(f"pattern symbol '{symbol}'") + ".*" + re.escape(dependency.package)
    ):
        require_symbol_dependencies("WE" + symbol)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object())
    require_symbol_dependencies("WE" + symbol)
