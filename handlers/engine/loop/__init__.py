"""The engine loop shared by the engines that step in a thread (torch, llama.cpp): each brings
its forward passes (a `Runner`, runner.py); the rest is here. `ContinuousBatcher` (batcher.py,
with sequence.py, sampling.py, prefix_cache.py) steps them; `EngineLoop` (thread.py) is the
thread that steps it, its inbox and its supervision; `LoopEngine` (engine.py) is the asyncio
engine over it, and `DirectStepper` (direct.py) the same batcher stepped by its caller (DJL)."""
