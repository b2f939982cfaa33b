"""Public-API smoke test: the package imports without CUDA and without megatron-core's optional deps."""

import subprocess
import sys

import mhc


def test_version_matches_pyproject():
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert mhc.__version__ == meta["project"]["version"]


def test_all_names_resolve():
    for name in mhc.__all__:
        assert hasattr(mhc, name), name


def test_import_without_optional_deps():
    # transformer_engine / apex set to None in sys.modules make any import of them raise ImportError.
    code = (
        "import sys; sys.modules['transformer_engine'] = None; sys.modules['apex'] = None; "
        "import torch; torch.cuda.is_available = lambda: False; import mhc"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_does_not_load_megatron():
    code = "import sys, mhc; assert 'megatron' not in sys.modules, 'import mhc must not import megatron-core'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_megatron_surface():
    import mhc.megatron as mm

    for name in mm.__all__:
        assert hasattr(mm, name), name
