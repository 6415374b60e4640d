"""The one registry pattern: entries register where they live, `locations` and entry points load on first lookup."""

import subprocess
import sys
import textwrap
import threading
from importlib import metadata
from itertools import count

import pytest

from clipseg_sparse.errors import UserError
from clipseg_sparse.registry import ENTRY_POINT_GROUP, Registry, UnknownNameError, caller_module

_ids = count()


def _modules(tmp_path, monkeypatch, **sources: str) -> dict[str, str]:
    """Write each source as a module with a name unique to this test run; `{NAME}` in a source is replaced by
    the unique name of module NAME. Returns name -> unique module name."""
    names = {key: f"reg_{key}_{next(_ids)}" for key in sources}
    for key, text in sources.items():
        for other, unique in names.items():
            text = text.replace("{" + other + "}", unique)
        (tmp_path / f"{names[key]}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return names


HOME = """
    from clipseg_sparse.registry import Registry
    REG = Registry("thing", locations=("{plugin}",))
"""


@pytest.mark.parametrize("lookup", ["get", "names", "contains", "iter", "len", "help", "where"])
def test_locations_are_imported_on_the_first_lookup_of_any_kind(tmp_path, monkeypatch, lookup):
    names = _modules(tmp_path, monkeypatch, home=HOME, plugin="from {home} import REG\nREG.register('a', 1, help='the a')\n")
    import importlib

    home = importlib.import_module(names["home"])
    assert names["plugin"] not in sys.modules
    first = {
        "get": lambda r: r.get("a"),
        "names": lambda r: r.names(),
        "contains": lambda r: "a" in r,
        "iter": lambda r: list(r),
        "len": lambda r: len(r),
        "help": lambda r: r.help("a"),
        "where": lambda r: r.where("a"),
    }[lookup]
    assert first(home.REG)
    assert names["plugin"] in sys.modules and home.REG.names() == ["a"]


def test_a_lookup_while_the_locations_load_does_not_recurse(tmp_path, monkeypatch):
    """A method module that reads an entry registered before it (gem reading clearclip's protocol) while the
    catalog loads sees the entries registered so far."""
    names = _modules(
        tmp_path, monkeypatch, home=HOME,
        plugin="from {home} import REG\nREG.register('a', 1)\nREG.register('b', REG.get('a') + 1)\nSEEN = REG.names()\n",
    )  # fmt: skip
    import importlib

    home = importlib.import_module(names["home"])
    assert home.REG.get("b") == 2 and sys.modules[names["plugin"]].SEEN == ["a", "b"]


def test_another_thread_waits_until_every_entry_is_in(tmp_path, monkeypatch):
    names = _modules(
        tmp_path, monkeypatch, home=HOME,
        plugin="import time\nfrom {home} import REG\nREG.register('a', 1)\ntime.sleep(0.3)\nREG.register('b', 2)\n",
    )  # fmt: skip
    import importlib

    home = importlib.import_module(names["home"])
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(home.REG.names())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [["a", "b"]] * 3


def test_where_names_the_registering_module(tmp_path, monkeypatch):
    """`register` records its caller's module (a dataclass instance has no module of its own), a helper
    passes its caller's, the decorator the object's."""
    names = _modules(
        tmp_path, monkeypatch,
        helper="""
            from clipseg_sparse.registry import Registry, caller_module
            REG = Registry("thing")
            def register_thing(name, value, module=None):
                REG.register(name, value, module=module or caller_module())
        """,
        user="""
            from dataclasses import dataclass
            from {helper} import REG, register_thing
            @dataclass(frozen=True)
            class Thing:
                x: int
            REG.register("direct", Thing(1))
            register_thing("helped", Thing(2))
            @REG.decorator("decorated")
            def f():
                pass
        """,
    )  # fmt: skip
    import importlib

    helper = importlib.import_module(names["helper"])
    importlib.import_module(names["user"])
    assert {n: helper.REG.where(n) for n in helper.REG} == {"direct": names["user"], "helped": names["user"], "decorated": names["user"]}
    assert caller_module(0) == __name__


def test_a_name_registered_twice_is_refused():
    reg = Registry("thing")
    reg.register("a", 1)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a", 2)
    assert reg.get("a") == 1


def test_an_unknown_name_is_a_user_error_with_close_matches():
    reg = Registry("thing")
    reg.register("sclip", 1)
    reg.register("clearclip", 2)
    with pytest.raises(UnknownNameError) as info:
        reg.get("sclp")
    assert isinstance(info.value, (UserError, KeyError, ValueError))
    assert str(info.value) == "unknown thing 'sclp'. Did you mean 'sclip'? Choices: sclip, clearclip"


def test_entry_point_modules_load_with_the_locations(tmp_path, monkeypatch):
    """Third-party methods: `[project.entry-points."clipseg_sparse.methods"] mine = "my_pkg.my_method"`."""
    names = _modules(
        tmp_path, monkeypatch, home=HOME.replace(",))", ",), group='clipseg_sparse.methods')"),
        plugin="from {home} import REG\nREG.register('builtin', 1)\n",
        third="from {home} import REG\nREG.register('mine', 2)\n",
    )  # fmt: skip
    asked = []

    def entry_points(group):
        asked.append(group)
        return [metadata.EntryPoint(name="mine", value=names["third"], group=group)]

    monkeypatch.setattr("clipseg_sparse.registry.metadata.entry_points", entry_points)
    import importlib

    home = importlib.import_module(names["home"])
    assert home.REG.names() == ["builtin", "mine"] and asked == [ENTRY_POINT_GROUP]
    assert home.REG.where("mine") == names["third"]


def test_the_package_registries_name_where_their_entries_live():
    from clipseg_sparse.attention.spec import OPTIONS, PRESETS
    from clipseg_sparse.attention.taps import TAPS
    from clipseg_sparse.evaluation.protocols import PROTOCOLS
    from clipseg_sparse.stages import STAGES

    assert PRESETS.where("sclip") == PRESETS.where("sclip-entmax") == "clipseg_sparse.methods.sclip"
    assert PROTOCOLS.where("gem") == "clipseg_sparse.methods.gem"
    assert STAGES.where("pamr") == "clipseg_sparse.stages" and STAGES.where("lof") == "clipseg_sparse.methods.scclip"
    assert TAPS.where("ext") == "clipseg_sparse.models.proxies" and TAPS.where("feedback") == "clipseg_sparse.attention.feedback"
    assert OPTIONS.where("dna") == "clipseg_sparse.dna.spec_option"
    for name in PRESETS:
        assert PRESETS.where(name).startswith("clipseg_sparse.methods."), name
    for name in PROTOCOLS:
        assert PROTOCOLS.where(name).startswith("clipseg_sparse.methods."), name


def test_the_engine_imports_no_method_model_or_dna():
    code = (
        "import sys, clipseg_sparse.attention\n"
        "print(sorted(m for m in sys.modules if m.startswith(('clipseg_sparse.methods', 'clipseg_sparse.dna', "
        "'clipseg_sparse.models'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_method_file_in_the_folder_is_imported_without_an_edit(tmp_path, monkeypatch):
    """A new method is its own file: a module in the methods folder that `METHODS` does not name is imported
    with the others (its presets then exist), so adding a method edits no other package file."""
    import clipseg_sparse.methods as methods
    from clipseg_sparse.attention import PRESETS

    (tmp_path / "zz_new_method.py").write_text(
        "from clipseg_sparse.attention.presets import register_preset\n"
        "register_preset('zz-new-method', 'qq/softmax', 'a test method')\n"
    )
    monkeypatch.setattr(methods, "__path__", [*methods.__path__, str(tmp_path)])
    for table in ("_items", "_help", "_where"):
        monkeypatch.setattr(PRESETS, table, dict(getattr(PRESETS, table)))
    try:
        methods.import_methods()
        assert "zz_new_method" not in methods.METHODS and str(PRESETS.get("zz-new-method").spec) == "qq/softmax"
        assert PRESETS.where("zz-new-method") == "clipseg_sparse.methods.zz_new_method"
    finally:
        sys.modules.pop("clipseg_sparse.methods.zz_new_method", None)
