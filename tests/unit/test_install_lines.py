"""Every install line of the user docs names something that exists: broker-lookup is not
published to PyPI yet, so it installs from a checkout (``pip install ./``); the chart's
image is built and pushed by the reader, and the README's deploy block says so."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "deploy" / "README.md",
    ROOT / "deploy" / "Dockerfile",
    ROOT / "deploy" / "vllm" / "Dockerfile",
    ROOT / "scripts" / "install-vllm-cpu",
]
#: A requirement naming our distribution on an index: broker-lookup, broker_lookup[x]==1.
_FROM_INDEX = re.compile(r"^broker[-_]lookup(\[[^\]]*\])?([=<>!~].*)?$", re.IGNORECASE)
_PIP = re.compile(r"pip3?\s+install\s+([^`|;&\n]+)")


def install_lines() -> list[tuple[str, str]]:
    """(file, requirements) of every ``pip install`` in the docs, deploy files and scripts."""
    found = []
    for path in SOURCES:
        for match in _PIP.finditer(path.read_text()):
            found.append((path.relative_to(ROOT).as_posix(), match.group(1)))
    return found


def test_no_install_line_asks_an_index_for_broker_lookup() -> None:
    lines = install_lines()
    assert any("./" in reqs for _, reqs in lines)  # the scan sees the docs' lines
    for where, reqs in lines:
        words = reqs.split("#", 1)[0].split()
        wrong = [w for w in words if _FROM_INDEX.match(w.strip("\"'"))]
        assert not wrong, f"{where}: `pip install {reqs.strip()}` asks PyPI for {wrong}"


def test_the_scan_catches_an_install_from_the_index() -> None:
    assert _FROM_INDEX.match("broker-lookup")
    assert _FROM_INDEX.match("broker_lookup[dev]==0.1.0")
    assert not _FROM_INDEX.match("/src/broker-lookup")
    assert not _FROM_INDEX.match("./")


def test_the_readme_deploy_block_builds_pushes_and_sets_the_image() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Deploy", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    build = re.search(r"docker build -f deploy/Dockerfile -t (\S+):(\S+) \.", block)
    assert build, block
    repository, tag = build.groups()
    assert f"docker push {repository}:{tag}" in block
    assert f"--set image.repository={repository}" in block
    assert "docker build -f deploy/vllm/Dockerfile" in block


_HELM_INSTALL = re.compile(r"helm install \S+ helm/broker-lookup(?:[^\n]*\\\n)*[^\n]*")


def test_every_chart_install_line_sets_the_image() -> None:
    """The chart refuses to render without ``image.repository``: every documented
    ``helm install`` of it (continuation lines included) sets one."""
    found = []
    for path in SOURCES:
        for match in _HELM_INSTALL.finditer(path.read_text()):
            found.append(match.group(0))
            assert "image.repository" in match.group(0), f"{path.name}: {match.group(0)}"
    assert len(found) >= 4
