"""Servers and engines built in tests decode eagerly unless a test asks for the compiled step:
compiling it takes minutes (tests/engines/test_decode_graphs.py compiles the tiny model's and
checks it against the eager step)."""

import os

os.environ.setdefault("OPTION_ENFORCE_EAGER", "true")
