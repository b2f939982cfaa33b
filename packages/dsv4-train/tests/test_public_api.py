"""Public-API smoke test: the package imports without CUDA and without megatron-core's optional deps."""

import subprocess
import sys

import dsv4_train


def test_version_matches_pyproject():
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert dsv4_train.__version__ == meta["project"]["version"]


def test_all_names_resolve():
    for name in dsv4_train.__all__:
        assert hasattr(dsv4_train, name), name


def test_import_without_optional_deps():
    # transformer_engine / apex set to None in sys.modules make any import of them raise ImportError.
    code = (
        "import sys; sys.modules['transformer_engine'] = None; sys.modules['apex'] = None; "
        "import torch; torch.cuda.is_available = lambda: False; import dsv4_train"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
