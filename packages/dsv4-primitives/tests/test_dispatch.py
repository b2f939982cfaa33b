"""dsv4_primitives.dispatch: the one backend rule of the workspace (auto / triton / reference, env variables)."""

import pytest
import torch

from dsv4_primitives.dispatch import (
    GLOBAL_ENV_VAR,
    env_backend,
    normalize_backend,
    package_env_var,
    resolve_backend,
)

OP = "some_pkg.op"
PKG_VAR = "SOME_PKG_BACKEND"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(PKG_VAR, raising=False)
    monkeypatch.delenv(GLOBAL_ENV_VAR, raising=False)


def test_package_variable_is_derived_from_the_op_name():
    assert package_env_var("csa_kernels.sparse_attn") == "CSA_KERNELS_BACKEND"
    assert package_env_var("dsv4_primitives.rms_norm") == "DSV4_PRIMITIVES_BACKEND"
    assert package_env_var("mhc.mhc_pre") == "MHC_BACKEND"
    assert package_env_var("hash_moe.topk_route") == "HASH_MOE_BACKEND"


def test_auto_is_triton_only_when_every_input_is_on_cuda():
    cpu = torch.zeros(2)
    assert resolve_backend("auto", cpu, op=OP) == "reference"
    assert resolve_backend("auto", op=OP) == "reference"  # no tensor: nothing lives on CUDA
    assert resolve_backend("auto", cpu, None, 3, op=OP) == "reference"  # non-tensors are ignored


def test_env_precedence(monkeypatch):
    cpu = torch.zeros(2)
    monkeypatch.setenv(GLOBAL_ENV_VAR, "triton")
    assert env_backend(OP) == ("triton", GLOBAL_ENV_VAR)
    assert resolve_backend("auto", cpu, op=OP) == "triton"  # the CPU suite runs under the interpreter
    monkeypatch.setenv(PKG_VAR, "reference")
    assert resolve_backend("auto", cpu, op=OP) == "reference"  # the package variable beats the global one
    monkeypatch.setenv(PKG_VAR, " AUTO ")
    assert env_backend(OP) == ("triton", GLOBAL_ENV_VAR)  # auto defers to the next variable
    assert resolve_backend("reference", cpu, op=OP) == "reference"  # an explicit argument always wins
    monkeypatch.setenv(PKG_VAR, "fast")
    with pytest.raises(ValueError, match=f"{PKG_VAR}='fast' must be one of"):
        resolve_backend("auto", cpu, op=OP)


def test_errors_name_the_op_and_the_fix(monkeypatch):
    cpu = torch.zeros(2)
    with pytest.raises(
        ValueError, match=r"some_pkg.op: backend must be one of \('auto', 'triton', 'reference'\)"
    ):
        resolve_backend("cuda", cpu, op=OP)
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("torch", cpu, op=OP)  # the former alias of "reference" is gone
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(
        ValueError, match=r"some_pkg\.op: backend=.triton. needs a CUDA tensor.*TRITON_INTERPRET=1"
    ):
        resolve_backend("triton", cpu, op=OP)
    monkeypatch.setenv(GLOBAL_ENV_VAR, "triton")
    with pytest.raises(ValueError, match=f"{GLOBAL_ENV_VAR}=triton needs a CUDA tensor"):
        resolve_backend("auto", cpu, op=OP)


def test_normalize_backend_custom_names():
    names = ("auto", "fast", "loop")
    assert normalize_backend("reference", OP, names, aliases={"reference": "loop"}) == "loop"
    with pytest.raises(ValueError, match=r"\('auto', 'fast', 'loop', 'reference'\)"):
        normalize_backend("x", OP, names, aliases={"reference": "loop"})


@pytest.mark.gpu
def test_auto_rules_on_cuda():
    gpu, cpu = torch.zeros(2, device="cuda"), torch.zeros(2)
    assert resolve_backend("auto", gpu, op=OP) == "triton"
    assert resolve_backend("auto", gpu, cpu, op=OP) == "reference"
    assert resolve_backend("auto", gpu.double(), op=OP, triton_dtypes=(torch.float32,)) == "reference"
    assert resolve_backend("auto", gpu, op=OP, triton_dtypes=(torch.float32,)) == "triton"
