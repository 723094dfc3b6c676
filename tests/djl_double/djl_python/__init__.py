"""A test double of DJL Serving's `djl_python` package (engines/python/setup/djl_python).

Written from its documented behaviour, not its code: only what `handle()` entries use, namely
`Input` (properties, content, batches), `Output` (content, properties, status, streams,
binary-encoded records) and `test_model.TestHandler`'s two flows.
"""

from djl_python.inputs import Input
from djl_python.outputs import Output
from djl_python.pair_list import PairList

__all__ = ["Input", "Output", "PairList"]
