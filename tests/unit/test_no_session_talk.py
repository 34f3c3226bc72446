"""The repository reads as a product, not as the log of how it was built: no tracked text
file (code, comments, docs, charts, tests, benchmarks) refers to a development issue by
number ("issue 12"), to a numbered stop of a work session, to "this box" (whichever
machine a session ran on) or to an earlier state of the code ("as before"). A reader has
none of those; the thing itself, or its reason, is said instead. Issues of other projects
keep their ``#`` (``LMCache issues #1739``) and are not matched.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What a session leaves behind, each with what to write instead.
RESIDUE = {
    re.compile(r"\b[Ii]ssues? \d+"): "a development issue's number: say what it is about",
    re.compile(r"\b[Ss]top \d+(?=[:),.;]|$)"): "a work session's stop: say what was done",
    re.compile(r"\b[Tt]his box\b"): "the machine a session ran on: name the machine",
    re.compile(r"\b[Aa]s before\b"): "an earlier state of the code: say what it does",
}


def tracked_text_files() -> list[Path]:
    """Every file git tracks here that reads as UTF-8 text."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = []
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if not name or path == Path(__file__).resolve() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode()
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def residue(text: str) -> list[tuple[int, str, str]]:
    """(line number, the words, why) of each piece of session talk in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, why in RESIDUE.items():
            for match in pattern.finditer(line):
                found.append((number, match.group(), why))
    return found


def test_the_patterns_catch_session_talk_and_spare_the_rest() -> None:
    caught = residue("fixed in issue 13\nstop 4: done\non this box\ntakes the queue as before")
    assert [number for number, _, _ in caught] == [1, 2, 3, 4]
    spared = "LMCache issues #1739, #2979\nthe soak stops 2 ranks\na 2-core box\nbefore ACLs"
    assert residue(spared) == []


def test_no_tracked_file_holds_session_talk() -> None:
    files = tracked_text_files()
    assert len(files) > 100 and ROOT / "README.md" in files
    found = [
        f"{path.relative_to(ROOT)}:{number}: {words!r} ({why})"
        for path in files
        for number, words, why in residue(path.read_text())
    ]
    assert not found, "\n".join(found)
