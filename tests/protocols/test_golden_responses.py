"""Every HTTP route's answers, byte for byte (ids and timings aside), as recorded in
`tests/golden/responses.json` on the FakeEngine: refactors of the server must not change what
clients receive. `python tests/golden/record.py` records them again when a change is meant."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest

GOLDEN = Path(__file__).parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))

from cases import GOLDEN_FILE, GROUPS, record_all  # noqa: E402

RECORDED = orjson.loads((GOLDEN / GOLDEN_FILE).read_bytes())


@pytest.fixture(scope="module")
def answers() -> dict:
    return record_all()


def test_every_case_was_recorded():
    names = [case.name for *_, cases in GROUPS for case in cases]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(RECORDED)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_answer_is_unchanged(answers, name):
    assert answers[name] == RECORDED[name]
