"""What chat-shaped protocols share (OpenAI's chat completions, Anthropic's Messages, the
Responses API, Databricks' chat, vLLM's `/tokenize` of messages), so that none borrows from
another: `requests` (the chat request every one of them runs as), `prompt` (messages -> the
prompt, through the model's chat template), `params` (to SamplingParams), `structured`
(`response_format` and forced tool calls as constrained decoding), `tool_calls` (the tool-call
text format and its parser), `answer` (what an answer is rendered from; content and calls
apart), `logprobs`, `admit` (the driver's checks: refusals by field, the output length fitted
to the context), `errors` (OpenAI's error shape, which the chat machinery raises).
"""
