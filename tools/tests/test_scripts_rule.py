"""The console-script rule of tools/check_dag.py: one package per script name, targets it may import."""

from check_dag import script_errors


def test_a_script_declared_by_two_packages_is_refused():
    scripts = {
        "hybrid-model": {"dsv4": "dsv4_train.cli:main"},
        "dsv4-train": {"dsv4": "dsv4_train.__main__:main"},
    }
    runtime = {"hybrid-model": {"torch"}, "dsv4-train": {"hybrid-model"}}
    errors = script_errors(scripts, runtime)
    assert any("'dsv4' is declared by hybrid-model, dsv4-train" in e for e in errors), errors
    assert any("hybrid-model/pyproject.toml: script 'dsv4' points into dsv4-train" in e for e in errors), (
        errors
    )


def test_scripts_into_the_own_package_or_a_dependency_above_pass():
    scripts = {"dsv4-train": {"dsv4": "dsv4_train.__main__:main", "x": "hybrid_model.tool:main"}}
    assert script_errors(scripts, {"dsv4-train": {"hybrid-model"}}) == []
    assert script_errors(scripts, {"dsv4-train": set()}) != []  # undeclared dependency
