"""Record every case's answer into responses.json: `python tests/golden/record.py` (from the
repository's root, in the project's venv). Run it only when a response is meant to change."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from cases import GOLDEN_FILE, record_all  # noqa: E402

if __name__ == "__main__":
    answers = record_all()
    (HERE / GOLDEN_FILE).write_bytes(orjson.dumps(answers, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"recorded {len(answers)} answers into {HERE / GOLDEN_FILE}")
