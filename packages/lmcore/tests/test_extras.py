"""The `hf` extra: a missing transformers or peft is one line naming the extra; other import errors stay as they are."""

import sys

import pytest

from lmcore.extras import MissingExtraError, extra_hint, import_hf, install_hint


@pytest.mark.parametrize("module", ["transformers", "peft", "transformers.models.mpt"])
def test_missing_hf_library_is_one_line_naming_the_extra(module, monkeypatch):
    top = module.split(".")[0]
    monkeypatch.setattr(sys, "version_info", (3, 11, 7, "final", 0))  # where the extra installs (the test below: 3.10)
    # the library looks uninstalled, submodules that earlier tests imported included
    for name in [m for m in sys.modules if m.split(".")[0] == top] or [top]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtraError) as err:
        import_hf(module, "export_hf")
    assert str(err.value) == f"export_hf needs {top}, which is not installed: {install_hint('hf')}"


def test_the_app_names_its_own_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(sys, "version_info", (3, 11, 7, "final", 0))
    with pytest.raises(MissingExtraError, match=r"^lmtrain export needs transformers, .*lmtrain\[hf\]['\"]$"):
        import_hf("transformers", "lmtrain export", dist="lmtrain")


def test_on_python_3_10_the_hf_extra_asks_for_a_newer_python_not_an_impossible_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(sys, "version_info", (3, 10, 13, "final", 0))
    with pytest.raises(MissingExtraError) as err:
        import_hf("transformers", "lmtrain export", dist="lmtrain")
    assert str(err.value) == (
        "lmtrain export needs transformers, which is not installed: its hf extra needs Python 3.11 or newer "
        "(transformers 5.24+), this is Python 3.10: use a Python 3.11+ environment"
    )
    assert extra_hint("gguf", python=(3, 10)) == install_hint("gguf")  # the other extras install on 3.10


def test_an_installed_library_missing_its_own_dependency_keeps_that_error(monkeypatch, tmp_path):
    # A stand-in `peft` whose own import fails: the message must name the real cause, not the extra.
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "__init__.py").write_text("import lmcore_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "peft", raising=False)
    with pytest.raises(ModuleNotFoundError) as err:
        import_hf("peft", "export_hf")
    assert not isinstance(err.value, MissingExtraError)
    assert err.value.name == "lmcore_test_absent_dependency"


def test_only_the_hf_libraries_are_accepted():
    with pytest.raises(ValueError, match="provides transformers, peft only"):
        import_hf("torch", "export_hf")


def test_install_hint_names_the_checkout_directory_pip_installed_from(monkeypatch, tmp_path):
    import json
    from importlib import metadata

    checkout = tmp_path / "packages" / "PKG"
    checkout.mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\n")
    recorded = {"none": None, "wheel": {"url": "https://example.org/x.whl", "archive_info": {}},
                "dir": {"url": checkout.as_uri(), "dir_info": {}},
                "editable": {"url": checkout.as_uri(), "dir_info": {"editable": True}}}  # fmt: skip
    monkeypatch.chdir(tmp_path)
    hints = {}
    for kind, info in recorded.items():

        class Dist:
            def read_text(self, name, info=info):
                return None if info is None else json.dumps(info)

        monkeypatch.setattr(metadata, "distribution", lambda dist: Dist())
        hints[kind] = install_hint("EXTRA", "dist-name")
    assert hints["none"] == hints["wheel"] == "pip install 'dist-name[EXTRA]'"  # no checkout recorded
    assert hints["dir"] == 'pip install "packages/PKG[EXTRA]"'
    assert hints["editable"] == 'pip install -e "packages/PKG[EXTRA]"'
