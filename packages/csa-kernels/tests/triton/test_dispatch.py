"""Backend resolution rules of the dispatcher."""

import pytest
import torch

from csa_kernels._dispatch import ENV_VAR, resolve_backend


def test_auto_is_reference_on_cpu(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend("auto", torch.zeros(2)) == "reference"


def test_explicit_backend_wins(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert resolve_backend("triton", torch.zeros(2)) == "triton"


def test_env_overrides_auto(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    assert resolve_backend("auto", torch.zeros(2)) == "triton"
    monkeypatch.setenv(ENV_VAR, "auto")
    assert resolve_backend("auto", torch.zeros(2)) == "reference"


def test_bad_names_raise(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", torch.zeros(2))
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_backend("auto", torch.zeros(2))


@pytest.mark.gpu
def test_auto_is_triton_on_cuda(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend("auto", torch.zeros(2, device="cuda")) == "triton"
