// The page's logic, plain JavaScript: the status refreshed from the server's own routes
// (/config, /ping, /metrics, /v1/models, /models, /adapters), a chat streamed through
// /v1/chat/completions, LMI's /invocations with its exact bodies. It changes nothing on the
// server but through those routes, and reaches nothing but this server.
"use strict";

// The server's root, from where this script was served: any port, any path prefix.
const BASE = new URL("..", document.currentScript.src);
const REFRESH_MS = 2000;
// The API key lives in this tab's sessionStorage: it survives a reload, not the tab; it is
// never written for later sessions (localStorage would keep it on disk), never put in a URL
// (history, logs and Referer headers keep those), and is sent to this server only.
const KEY_ITEM = "lmi-serve.api-key";
const $ = (selector) => document.querySelector(selector);

class Unauthorized extends Error {}

// -- talking to the server -----------------------------------------------------------------

async function call(path, init = {}) {
  const headers = new Headers(init.headers);
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(new URL(path, BASE), {...init, headers});
  if (response.status === 401) {
    askForKey(key === null ? null : await errorMessage(response));
    throw new Unauthorized();
  }
  return response;
}

// The message of an error body in any of the server's shapes ({"error": "..."}, OpenAI's
// {"error": {"message": ...}}, ...), else its text.
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const error = body.error ?? body.message ?? body;
    return typeof error === "string" ? error : error.message ?? text;
  } catch {
    return text || `${response.status} ${response.statusText}`;
  }
}

async function json(path) {
  const response = await call(path);
  if (!response.ok) throw new Error(`${path}: ${await errorMessage(response)}`);
  return response.json();
}

// Server-sent events' data, one string per event, as they arrive.
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

// -- the API key ---------------------------------------------------------------------------

function askForKey(message) {
  stopRefreshing();
  $("#key-form").hidden = false;
  $("#key-error").textContent = message ?? "";
  $("#key-input").focus();
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, $("#key-input").value);
  $("#key-input").value = "";
  $("#key-form").hidden = true;
  refresh();
});

// -- status --------------------------------------------------------------------------------

let timer = null;
let lastTokens = null;  // [generated tokens, when] at the previous refresh, for throughput
let settings = [];  // the configuration as last read, for the filter

function stopRefreshing() {
  clearTimeout(timer);
  timer = null;
}

async function refresh() {
  stopRefreshing();
  try {
    const config = await json("config");
    $("#status-error").textContent = "";
    showModel(config);
    await Promise.all([showHealth(), showLive(), showServed(config)]);
  } catch (error) {
    if (error instanceof Unauthorized) return;  // until a key is given
    $("#status-error").textContent = String(error.message ?? error);
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

function facts(list, entries) {
  list.replaceChildren(...entries.flatMap(([name, value]) => {
    const term = document.createElement("dt");
    const detail = document.createElement("dd");
    term.textContent = name;
    detail.textContent = value ?? "—";
    detail.dataset.fact = name;
    return [term, detail];
  }));
}

function showModel(config) {
  $("#model-name").textContent = config.model;
  facts($("#model-facts"), [
    ["model", config.model], ["engine", config.engine], ["dtype", config.dtype],
    ["quantization", config.quantization], ["KV cache", config.kv_cache_dtype],
    ["device", config.device],
    ["context", config.max_model_len], ["embedding model", config.embedding_model],
    ["version", config.version],
  ]);
  if (JSON.stringify(config.settings) !== JSON.stringify(settings)) {  // keep a selection
    settings = config.settings;
    showConfiguration();
  }
}

function showConfiguration() {
  const filter = $("#config-filter").value.toLowerCase();
  const rows = settings.filter((s) => !filter ||
    [s.key, s.value, s.source].some((text) => text.toLowerCase().includes(filter)));
  $("#config tbody").replaceChildren(...rows.map((setting) => {
    const row = document.createElement("tr");
    row.dataset.key = setting.key;
    for (const [name, text] of [["key", setting.key], ["value", setting.value],
                                ["source", setting.note ? `${setting.source}; ${setting.note}`
                                                        : setting.source]]) {
      const cell = document.createElement("td");
      cell.className = name;
      cell.textContent = text;
      row.append(cell);
    }
    return row;
  }));
}

async function showHealth() {
  const response = await call("ping");
  const healthy = response.ok;
  const badge = $("#health");
  badge.dataset.state = healthy ? "healthy" : "unhealthy";
  badge.textContent = healthy ? "healthy" : `unhealthy (${response.status})`;
}

// Prometheus' text format: each metric's samples summed over its series (every model's).
function metricSums(text) {
  const sums = new Map();
  for (const line of text.split("\n")) {
    const match = /^([A-Za-z_:][\w:]*)(?:\{.*\})?\s+(\S+)/.exec(line);
    if (match) sums.set(match[1], (sums.get(match[1]) ?? 0) + Number(match[2]));
  }
  return sums;
}

async function showLive() {
  const response = await call("metrics");
  const sums = metricSums(await response.text());
  const tokens = sums.get("lmi_generated_tokens_total") ?? 0;
  const now = performance.now();
  let throughput = null;
  if (lastTokens !== null && now > lastTokens[1]) {
    throughput = `${((tokens - lastTokens[0]) * 1000 / (now - lastTokens[1])).toFixed(1)} tokens/s`;
  }
  lastTokens = [tokens, now];
  const kv = sums.get("vllm:kv_cache_usage_perc");
  facts($("#live-facts"), [
    ["throughput", throughput],
    ["running requests", sums.get("lmi_running_requests") ?? 0],
    ["waiting requests", sums.get("lmi_waiting_requests") ?? 0],
    ["KV cache use", kv === undefined ? null : `${(kv * 100).toFixed(1)} %`],
    ["tokens generated", tokens],
  ]);
}

async function showServed(config) {
  const list = await json("v1/models");
  const loaded = await json("models").catch(() => ({models: []}));
  const adapters = config.engine === null ? {adapters: []}
    : await json("adapters").catch(() => ({adapters: []}));
  const pinned = new Map(adapters.adapters.map((a) => [a.name, a.pin]));
  const runtime = new Map(loaded.models.map((m) => [m.modelName, m]));
  $("#served-models").replaceChildren(...list.data.map((card) => {
    const item = document.createElement("li");
    item.dataset.model = card.id;
    let what = card.parent ? `LoRA adapter of ${card.parent}` : "model";
    if (card.parent && pinned.get(card.id)) what += ", pinned";
    if (runtime.has(card.id)) {
      what = `loaded at runtime from ${runtime.get(card.id).modelUrl}` +
             (runtime.get(card.id).ready ? "" : ", not ready");
    }
    item.textContent = `${card.id} (${what})`;
    return item;
  }));
}

$("#config-filter").addEventListener("input", showConfiguration);

// -- tabs ----------------------------------------------------------------------------------

for (const tab of document.querySelectorAll("[role=tab]")) {
  tab.addEventListener("click", () => {
    for (const other of document.querySelectorAll("[role=tab]")) {
      other.setAttribute("aria-selected", String(other === tab));
      document.getElementById(other.dataset.tab).hidden = other !== tab;
    }
  });
}

// -- chat ----------------------------------------------------------------------------------

const conversation = [];  // the user's and the assistant's messages so far
let streaming = null;  // the AbortController of the answer in flight

function chatBody(turn) {
  const body = {
    messages: [...conversation, turn],
    stream: true,
    stream_options: {include_usage: true},
    temperature: Number($("#temperature").value),
    max_tokens: Number($("#max-tokens").value),
  };
  const system = $("#system").value.trim();
  if (system) body.messages.unshift({role: "system", content: system});
  const stop = $("#stop").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  const tools = $("#tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);  // a SyntaxError is shown as the answer's error
  return body;
}

function bubble(role) {
  const message = document.createElement("div");
  message.className = `message ${role}`;
  $("#transcript").append(message);
  return message;
}

// One assistant answer as it streams: its thinking apart, its text, its tool calls as calls.
class Answer {
  constructor() {
    this.element = bubble("assistant");
    this.element.dataset.state = "streaming";
    this.reasoning = document.createElement("details");
    this.reasoning.className = "reasoning";
    this.reasoning.open = true;
    this.reasoning.hidden = true;
    this.reasoning.append(Object.assign(document.createElement("summary"),
                                        {textContent: "reasoning"}));
    this.thoughts = document.createElement("div");
    this.reasoning.append(this.thoughts);
    this.content = Object.assign(document.createElement("div"), {className: "content"});
    this.calls = [];
    this.element.append(this.reasoning, this.content);
    this.text = "";
  }

  think(text) {
    this.reasoning.hidden = false;
    this.thoughts.append(text);
  }

  say(text) {
    this.text += text;
    this.content.append(text);  // a text node per delta: the DOM grows as the answer streams
  }

  call(delta) {
    const index = delta.index ?? 0;
    if (!this.calls[index]) {
      const element = Object.assign(document.createElement("div"), {className: "tool-call"});
      const name = Object.assign(document.createElement("span"), {className: "tool-name"});
      const args = Object.assign(document.createElement("code"), {className: "tool-arguments"});
      element.append(name, "(", args, ")");
      this.element.append(element);
      this.calls[index] = {name, args};
    }
    const shown = this.calls[index];
    if (delta.function?.name) shown.name.textContent += delta.function.name;
    if (delta.function?.arguments) shown.args.textContent += delta.function.arguments;
  }

  end(state, message) {
    this.element.dataset.state = state;
    if (message) {
      this.element.append(Object.assign(document.createElement("p"),
                                        {className: "error", textContent: message}));
    }
  }
}

// A turn joins the conversation once its answer is whole: a failed or stopped one is not sent
// again with the next.
async function send(text) {
  bubble("user").textContent = text;
  const turn = {role: "user", content: text};
  const answer = new Answer();
  let body;
  try {
    body = chatBody(turn);
  } catch (error) {
    answer.end("error", `tools: ${error.message}`);
    return;
  }
  streaming = new AbortController();
  setStreaming(true);
  const timing = {started: performance.now(), first: null, pieces: 0, usage: null};
  try {
    const response = await call("v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(body), signal: streaming.signal});
    if (!response.ok) {
      answer.end("error", await errorMessage(response));
      return;
    }
    await readChunks(response, answer, timing);
    if (answer.element.dataset.state === "streaming") {
      conversation.push(turn, {role: "assistant", content: answer.text});
      answer.end("done");
    }
  } catch (error) {
    if (error.name === "AbortError") answer.end("stopped");
    else answer.end("error", error instanceof Unauthorized ? "an API key is required"
                                                           : String(error.message ?? error));
  } finally {
    streaming = null;
    setStreaming(false);
    showSpeed(timing);
  }
}

async function readChunks(response, answer, timing) {
  for await (const data of sseData(response)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) {
      answer.end("error", chunk.error.message ?? JSON.stringify(chunk.error));
      return;
    }
    if (chunk.usage) timing.usage = chunk.usage;
    for (const choice of chunk.choices ?? []) {
      const delta = choice.delta ?? {};
      const thinking = delta.reasoning_content ?? delta.reasoning;
      if (thinking || delta.content || delta.tool_calls?.length) {
        timing.first ??= performance.now();
        timing.pieces += 1;
      }
      if (thinking) answer.think(thinking);
      if (delta.content) answer.say(delta.content);
      for (const toolCall of delta.tool_calls ?? []) answer.call(toolCall);
    }
  }
}

// Time to first token, and tokens per second after it (the decode rate).
function showSpeed(timing) {
  const stats = $("#chat-stats");
  if (timing.first === null) {
    stats.textContent = "";
    return;
  }
  const end = performance.now();
  const tokens = timing.usage?.completion_tokens ?? timing.pieces;
  const ttft = timing.first - timing.started;
  const rate = tokens > 1 && end > timing.first ? (tokens - 1) * 1000 / (end - timing.first) : null;
  stats.dataset.ttftMs = ttft.toFixed(0);
  stats.textContent = `time to first token ${ttft.toFixed(0)} ms · ${tokens} tokens` +
                      (rate === null ? "" : ` · ${rate.toFixed(1)} tokens/s`);
}

function setStreaming(on) {
  $("#send").disabled = on;
  $("#stop-button").disabled = !on;
}

$("#chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("#chat-input").value;
  if (!text.trim() || streaming) return;
  $("#chat-input").value = "";
  send(text);
});
$("#chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("#chat-form").requestSubmit();
  }
});
$("#stop-button").addEventListener("click", () => streaming?.abort());
$("#clear").addEventListener("click", () => {
  streaming?.abort();
  conversation.length = 0;
  $("#transcript").replaceChildren();
  $("#chat-stats").textContent = "";
});

// -- /invocations --------------------------------------------------------------------------

$("#invoke-body").value = JSON.stringify(
  {inputs: "What is Deep Learning?", parameters: {max_new_tokens: 64}}, null, 2);

async function invoke() {
  const body = $("#invoke-body").value;
  $("#invoke-request").textContent = body;  // exactly the bytes sent
  $("#invoke-response").textContent = "";
  $("#invoke-status").textContent = "…";
  $("#invoke-boto3").textContent = boto3(body);
  try {
    const response = await call("invocations", {
      method: "POST", headers: {"Content-Type": "application/json"}, body});
    $("#invoke-status").textContent =
      `${response.status} ${response.headers.get("content-type") ?? ""}`;
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      $("#invoke-response").append(value);  // as it arrives: a stream's lines one by one
    }
  } catch (error) {
    $("#invoke-status").textContent = error instanceof Unauthorized
      ? "401: an API key is required" : String(error.message ?? error);
  }
}

// The same request from boto3, against a SageMaker endpoint (or this server as endpoint_url).
function boto3(body) {
  let streams = false;
  try {
    streams = JSON.parse(body).stream === true;
  } catch { /* sent as is: the server says what is wrong with it */ }
  const literal = JSON.stringify(body);  // a JSON string is a valid Python string literal
  const lines = [
    "import boto3",
    "",
    'client = boto3.client("sagemaker-runtime")',
    `body = ${literal}`,
  ];
  if (streams) {
    lines.push("response = client.invoke_endpoint_with_response_stream(",
               '    EndpointName="ENDPOINT", ContentType="application/json", Body=body)',
               'for event in response["Body"]:',
               '    print(event["PayloadPart"]["Bytes"].decode(), end="")');
  } else {
    lines.push("response = client.invoke_endpoint(",
               '    EndpointName="ENDPOINT", ContentType="application/json", Body=body)',
               'print(response["Body"].read().decode())');
  }
  return lines.join("\n");
}

$("#invoke-send").addEventListener("click", invoke);

refresh();
