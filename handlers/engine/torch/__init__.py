"""The torch engine: continuous batching over a Hugging Face causal LM (the CPU default).

oneDNN's AMX kernels (Sapphire Rapids and later) block a bf16 matmul's sums by the batch's
shape: on an AMX Xeon a greedy answer differed between a request alone and the same request in
a batch of 32. oneDNN is capped at AVX512-BF16 here, whose kernels keep each output's sums in
one order whatever the batch, unless the environment already names a cap. It is set when the
engine is imported, before oneDNN's first primitive (oneDNN reads it once); the dtype probe then
weighs bf16 against float32 as the engine will run them.
"""

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
