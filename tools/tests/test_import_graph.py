"""The file-level import-circle rule and the function-level import report of tools/check_dag.py, on small
synthetic packages."""

from pathlib import Path

from check_dag import circle_errors
from import_graph import function_level_imports, import_circles


def make_package(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (path relative to ``root`` -> source) and return ``root / "pkg"``."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "pkg"


def test_absolute_two_file_circle(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
            "pkg/b.py": "import pkg.a\n\ndef g():\n    return 1\n",
            "pkg/c.py": "from pkg import a\n",
        },
    )
    assert import_circles(pkg) == [["pkg.a", "pkg.b"]]


def test_relative_circle_through_three_files_and_a_function_level_import(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "from .x import X\n",
            "pkg/sub/x.py": "from .y import Y\nX = 1\n",
            "pkg/sub/y.py": "from ..z import Z\nY = 1\n",
            "pkg/z.py": "def make():\n    from .sub import x\n    return x\nZ = 1\n",
            "pkg/leaf.py": "from pkg.sub.x import X\n",
        },
    )
    assert import_circles(pkg) == [["pkg.sub.x", "pkg.sub.y", "pkg.z"]]


def test_two_separate_circles(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "from pkg import a\n",
            "pkg/c.py": "from . import d\n",
            "pkg/d.py": "from . import c\n",
        },
    )
    assert import_circles(pkg) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_init_re_export_edges_and_chains_are_no_circle(tmp_path):
    # the __init__ re-exports a and b, and a imports b through the package: an edge into __init__, ignored
    pkg = make_package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
            "pkg/a.py": "from pkg import B\nA = B\n",
            "pkg/b.py": "B = 1\n",
            "pkg/c.py": "from pkg.a import A\nfrom pkg.b import B\n",
            "pkg/other.py": "import os\nimport other_pkg.a\n",
        },
    )
    assert import_circles(pkg) == []


def test_circle_errors_name_the_package_and_every_file(tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import B\nA = 1\n",
            "pkg/b.py": "from pkg.a import A\nB = 1\n",
        },
    )
    (error,) = circle_errors("my-dist", pkg)
    assert error.startswith("my-dist: import circle between files: pkg.a <-> pkg.b")


def test_function_level_imports_report_only_first_party(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(
        "import os\n"
        "from pkg.a import A\n"
        "\n"
        "def f():\n"
        "    import json\n"
        "    from pkg.b import B\n"
        "    from . import c\n"
        "    def g():\n"
        "        import other.x\n"
        "    return B\n"
        "\n"
        "class K:\n"
        "    def m(self):\n"
        "        import pkg.d as d\n"
        "        from megatron.core import tensor_parallel\n"
    )
    assert function_level_imports(path, {"pkg", "other"}) == [
        (6, "pkg.b"),
        (7, "."),
        (9, "other.x"),
        (14, "pkg.d"),
    ]
