"""An engine module whose import fails, as vLLM's does beside an incompatible torchvision
(tests/fault_server.py serves it when LMI_FAULT_ENGINE_IMPORT is set)."""

raise RuntimeError("operator torchvision::nms does not exist")
