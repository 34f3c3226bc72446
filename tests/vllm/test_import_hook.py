"""The vLLM plugin's lazy patch, without vLLM or LMCache: a fake ``lmcache`` tree on sys.path.

Runs in the default suite (no ``vllm`` marker). The plugin must import nothing of
LMCache when vLLM loads it; it patches LMCache's factory once LMCache's own code imports
it, in that process and in a spawned one (vLLM's EngineCore and workers are spawned), in
each module layout (0.5.6's and 0.5.7's). Where it cannot (a layout it does not know) or
LMCache builds its own lookup anyway, each process logs one ERROR.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_lookup.integrations import import_hook, lmcache_layout

ROOT = Path(__file__).resolve().parents[2]

FACTORY_BODY = """
    import {package}.v1.lookup_client.abstract_client
    class LookupClientFactory:
        @staticmethod
        def create_lookup_client(config, metadata, engine=None):
            return "lmcache-client"
        @staticmethod
        def create_lookup_server(engine, metadata):
            return "lmcache-server"
"""
SERVICE_FACTORY_BODY = """
    class VllmServiceFactory:
        def __init__(self, lmcache_config):
            self.lmcache_config = lmcache_config
        def maybe_create_lookup_client(self):
            from {package}.v1.lookup_client.factory import LookupClientFactory
            return LookupClientFactory.create_lookup_client(self.lmcache_config, None)
        def maybe_create_lookup_server(self):
            return None
    def make_client():
        from {package}.v1.lookup_client.factory import LookupClientFactory
        return LookupClientFactory.create_lookup_client
"""
#: Where a release that moved its modules again might keep them: no Layout names it.
UNKNOWN_PACKAGE = "lmcache.v2"


def fake_lmcache(package: str, version: str) -> dict[str, str]:
    """A fake ``lmcache`` tree of ``version`` whose lookup modules lie under ``package``."""
    files = {"lmcache/__init__.py": f"__version__ = {version!r}\n"}
    interface = "import abc\nclass LookupClientInterface(abc.ABC):\n    pass\n"
    bodies = {
        lmcache_layout.ABSTRACT_CLIENT: interface,
        lmcache_layout.FACTORY: FACTORY_BODY,
        lmcache_layout.SERVICE_FACTORY: SERVICE_FACTORY_BODY,
    }
    for relative, body in bodies.items():
        parts = f"{package}.{relative}".split(".")
        for depth in range(1, len(parts)):
            files.setdefault("/".join(parts[:depth]) + "/__init__.py", "")
        files["/".join(parts) + ".py"] = body.replace("{package}", package)
    return files


CHILD = """
import json, multiprocessing, os, sys
from types import SimpleNamespace

SERVICE_FACTORY = os.environ["FAKE_SERVICE_FACTORY"]
BROKER = SimpleNamespace(extra_config={"lookup_broker_url": "redis://r:6379/0"})


def run(m):
    import importlib
    vsf = importlib.import_module(SERVICE_FACTORY)
    report = {"patched": m.is_installed(), "ours": vsf.make_client() is m._create_lookup_client}
    if os.environ.get("REPLACED"):  # someone put LMCache's own factory functions back
        m.uninstall()
        other = vsf.VllmServiceFactory(SimpleNamespace(extra_config={}))
        report["built"] = [other.maybe_create_lookup_client()] + [
            vsf.VllmServiceFactory(BROKER).maybe_create_lookup_client() for _ in range(2)
        ]
    return report


def probe(queue):
    from broker_lookup.integrations import lmcache as m
    m.vllm_plugin()  # vLLM loads its general plugins in each process it starts
    before = "lmcache" in sys.modules
    queue.put({"pid": os.getpid(), "lmcache_before": before, **run(m)})

if __name__ == "__main__":
    from broker_lookup.integrations import lmcache as m
    m.vllm_plugin()
    m.vllm_plugin()  # idempotent: one finder, one hook
    report = {"lmcache_at_load": sorted(k for k in sys.modules if k.split(".")[0] in
                                        ("lmcache", "torch", "vllm")),
              "finders": sum(type(f).__name__ == "PostImportFinder" for f in sys.meta_path)}
    report.update(run(m))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=probe, args=(queue,))
    child.start()
    report["spawned"] = queue.get(timeout=60)
    child.join(60)
    print("REPORT " + json.dumps(report))
"""


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, body in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))


def _run_child(
    tmp_path: Path,
    env_switch: str,
    package: str = "lmcache",
    version: str = "0.5.6",
    **env_extra: str,
) -> tuple[dict[str, object], str]:
    _write_tree(tmp_path / "site", fake_lmcache(package, version))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, BROKER_LOOKUP_LMCACHE=env_switch, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(ROOT)])
    env["FAKE_SERVICE_FACTORY"] = f"{package}.{lmcache_layout.SERVICE_FACTORY}"
    env.pop("BROKER_LOOKUP_REDIS_URL", None)
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :]), proc.stderr


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ERROR ")]


@pytest.mark.parametrize(
    "layout", lmcache_layout.LAYOUTS, ids=[lo.versions[0] for lo in lmcache_layout.LAYOUTS]
)
def test_plugin_patches_lmcache_only_when_lmcache_imports_it(
    tmp_path: Path, layout: lmcache_layout.Layout
) -> None:
    report, stderr = _run_child(tmp_path, "1", layout.package, layout.versions[0])
    assert report["lmcache_at_load"] == []  # nothing of lmcache, torch or vllm at load
    assert report["finders"] == 1
    assert report["patched"] is True and report["ours"] is True
    spawned = report["spawned"]
    assert isinstance(spawned, dict)
    assert spawned["lmcache_before"] is False
    assert spawned["patched"] is True and spawned["ours"] is True
    # INFO lines in both processes, with the module that triggered the patch
    assert stderr.count("broker-lookup armed") == 2
    assert stderr.count("patched LMCache's LookupClientFactory in pid") == 2
    assert f"on import of {layout.module(lmcache_layout.SERVICE_FACTORY)}" in stderr
    assert _errors(stderr) == [] and "WARNING" not in stderr


def test_unknown_layout_is_one_error_per_process(tmp_path: Path) -> None:
    report, stderr = _run_child(tmp_path, "1", UNKNOWN_PACKAGE, "0.6.0")
    assert report["patched"] is False and report["spawned"]["patched"] is False  # type: ignore[index]
    errors = _errors(stderr)
    assert len(errors) == 2, stderr  # the parent and the spawned child, once each
    for error in errors:
        assert "LMCache 0.6.0" in error and "none of the places" in error
        for layout in lmcache_layout.LAYOUTS:
            assert layout.module(lmcache_layout.FACTORY) in error
    assert "uses its own lookup transport" in errors[0]


def test_untested_version_of_a_known_layout_is_patched_with_a_warning(tmp_path: Path) -> None:
    layout = lmcache_layout.LAYOUTS[0]
    report, stderr = _run_child(tmp_path, "1", layout.package, "0.5.8")
    assert report["patched"] is True and report["ours"] is True
    assert _errors(stderr) == []
    assert stderr.count("not tested with LMCache 0.5.8") == 2


@pytest.mark.parametrize(
    "layout", lmcache_layout.LAYOUTS, ids=[lo.versions[0] for lo in lmcache_layout.LAYOUTS]
)
def test_lmcache_own_client_for_a_broker_config_is_one_error_per_process(
    tmp_path: Path, layout: lmcache_layout.Layout
) -> None:
    report, stderr = _run_child(tmp_path, "1", layout.package, layout.versions[0], REPLACED="1")
    assert report["built"] == ["lmcache-client"] * 3
    errors = _errors(stderr)
    assert len(errors) == 2, stderr  # two broker configs in each process: one ERROR each
    for error in errors:
        assert f"LMCache {layout.versions[0]}" in error
        assert "built its own lookup client builtins.str" in error
        assert "for a config that asks for the broker" in error


@pytest.fixture
def fake_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh uniquely named package ``<name>`` with a submodule ``<name>.mod``."""
    name = "blhook_" + uuid.uuid4().hex[:8]
    _write_tree(
        tmp_path,
        {f"{name}/__init__.py": "", f"{name}/mod.py": "VALUE = 42\ndef f():\n    return 1\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for key in [k for k in sys.modules if k.split(".")[0] == name]:
        del sys.modules[key]


def test_callback_runs_once_after_the_module_executed(fake_pkg: str) -> None:
    seen: list[object] = []
    key = f"test-{fake_pkg}"
    assert import_hook.when_imported([f"{fake_pkg}.mod"], lambda m: seen.append(m.VALUE), key=key)
    assert not import_hook.when_imported([f"{fake_pkg}.mod"], seen.append, key=key)
    assert seen == []
    module = __import__(f"{fake_pkg}.mod", fromlist=["VALUE"])
    assert seen == [42] and import_hook.hook_fired(key)
    # the module keeps its real loader: inspect and reload work as without the hook
    assert "def f" in inspect.getsource(module.f)
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    importlib.reload(module)
    assert seen == [42]
    import_hook.forget(key)


def test_already_imported_module_fires_at_once(fake_pkg: str) -> None:
    __import__(f"{fake_pkg}.mod")
    seen: list[str] = []
    key = f"test-now-{fake_pkg}"
    import_hook.when_imported([f"{fake_pkg}.mod"], lambda m: seen.append(m.__name__), key=key)
    assert seen == [f"{fake_pkg}.mod"]
    import_hook.forget(key)


def test_failing_callback_never_fails_the_import(
    fake_pkg: str, caplog: pytest.LogCaptureFixture
) -> None:
    def boom(module: object) -> None:
        raise RuntimeError("patch failed")

    key = f"test-boom-{fake_pkg}"
    import_hook.when_imported([f"{fake_pkg}.mod"], boom, key=key)
    with caplog.at_level(logging.ERROR, logger=import_hook.__name__):
        module = __import__(f"{fake_pkg}.mod", fromlist=["VALUE"])
    assert module.VALUE == 42
    assert "patch failed" in caplog.text and key in caplog.text
    import_hook.forget(key)


def test_unknown_module_is_left_to_the_other_finders(fake_pkg: str) -> None:
    key = f"test-missing-{fake_pkg}"
    import_hook.when_imported([f"{fake_pkg}.nope"], lambda m: None, key=key)
    with pytest.raises(ModuleNotFoundError):
        __import__(f"{fake_pkg}.nope")
    assert not import_hook.hook_fired(key)
    import_hook.forget(key)
