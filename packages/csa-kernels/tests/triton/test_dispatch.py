"""Backend resolution of the csa-kernels ops (the rule is :mod:`dsv4_primitives.dispatch`): ``CSA_KERNELS_BACKEND``
overrides ``auto`` (before the global ``DSV4_BACKEND``), an explicit argument wins, bad names raise."""

import pytest
import torch

import csa_kernels as ck
from dsv4_primitives.dispatch import resolve_backend

ENV_VAR = "CSA_KERNELS_BACKEND"
OP = "csa_kernels.sparse_attn"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("DSV4_BACKEND", raising=False)


def test_auto_is_reference_on_cpu():
    assert resolve_backend("auto", torch.zeros(2), op=OP) == "reference"


def test_explicit_backend_wins(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert resolve_backend("triton", torch.zeros(2), op=OP) == "triton"


def test_env_overrides_auto_and_package_variable_beats_global(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    assert resolve_backend("auto", torch.zeros(2), op=OP) == "triton"
    monkeypatch.setenv(ENV_VAR, "auto")
    assert resolve_backend("auto", torch.zeros(2), op=OP) == "reference"
    monkeypatch.setenv("DSV4_BACKEND", "triton")  # the package variable says auto: the global one decides
    assert resolve_backend("auto", torch.zeros(2), op=OP) == "triton"
    monkeypatch.setenv(ENV_VAR, "reference")
    assert resolve_backend("auto", torch.zeros(2), op=OP) == "reference"


def test_bad_names_raise(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", torch.zeros(2), op=OP)
    q, kv, idx = torch.zeros(3, 1, 8), torch.zeros(4, 8), torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"csa_kernels\.sparse_attn: backend must be one of"):
        ck.sparse_attn(q, kv, torch.zeros(1), idx, 1.0, backend="torch")  # "torch" was never a csa name
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_backend("auto", torch.zeros(2), op=OP)


def test_triton_outside_the_interpreter_names_the_op(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"csa_kernels\.sparse_attn: backend=.triton. needs a CUDA tensor"):
        resolve_backend("triton", torch.zeros(2), op=OP)


@pytest.mark.gpu
def test_auto_is_triton_on_cuda():
    assert resolve_backend("auto", torch.zeros(2, device="cuda"), op=OP) == "triton"
