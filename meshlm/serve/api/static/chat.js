// The chat page: keeps the conversation here, sends it to /v1/chat/completions with "stream": true,
// and shows the reply as its server-sent events arrive.
//
// The request must fit in the model's context (max_model_len, from /v1/models): prompt + max_tokens.
// Before sending, the page estimates the prompt's tokens from its UTF-8 bytes, at the tokens per byte
// the server's last usage report showed, and leaves out the oldest turns until it fits. When the
// estimate was short and the server answers 400 context_length_exceeded, the page leaves out one more
// turn and asks again; with no turn left to leave out and only max_tokens too large, it asks without
// max_tokens, for the rest of the context. A note in the conversation says which turns are left out.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"), composer: $("composer"), prompt: $("prompt"), send: $("send"), model: $("model"),
  apiKey: $("api-key"), temperature: $("temperature"), maxTokens: $("max-tokens"), system: $("system"), clear: $("clear"),
};

const REPLY_TOKENS = 256;         // the default reply length...
const REPLY_SHARE = 4;            // ...but at most a quarter of the context, leaving the rest to the conversation
const MESSAGE_OVERHEAD_BYTES = 16;  // a message's role and separators in the chat template, roughly
const PROMPT_OVERHEAD_BYTES = 16;   // the template's opening and the assistant's cue
const ESTIMATE_MARGIN = 1.1;      // an estimate is a guess; aim a little under the budget

const conversation = [];  // {role, content, element} of every turn sent or to be sent: user, assistant, user, ...
let firstSent = 0;        // the index in `conversation` of the first message still sent; those before are left out
let leftOutNote = null;   // the note shown after the last turn left out
let contextLength = null; // the model's context in tokens, when the server says it
let tokensPerByte = 1;    // prompt tokens per estimated byte: 1 at first (a byte-level tokenizer's worst case), then
                          // measured from the server's usage report on each reply
let inFlight = null;      // the AbortController of the reply being streamed
let epoch = 0;            // counts "Clear conversation": a reply that ends after one is not kept

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorBody(response) {
  try {
    const body = await response.json();
    if (body.error?.message) return body.error;
  } catch {}
  return { message: `HTTP ${response.status}` };
}

function defaultMaxTokens() {
  return contextLength ? Math.max(1, Math.min(REPLY_TOKENS, Math.floor(contextLength / REPLY_SHARE))) : REPLY_TOKENS;
}

// The reply length set in Settings; the default when the field is empty or not a count.
function maxTokens() {
  const n = Number.parseInt(ui.maxTokens.value, 10);
  return Number.isInteger(n) && n > 0 ? n : defaultMaxTokens();
}

function showReplyLength() {
  ui.maxTokens.placeholder = String(defaultMaxTokens());
  if (contextLength) ui.maxTokens.max = String(contextLength - 1);
  if (!ui.maxTokens.dataset.edited) ui.maxTokens.value = String(defaultMaxTokens());
}

async function showModel() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) throw new Error((await errorBody(response)).message);
    const { data } = await response.json();
    const card = data[0];
    contextLength = Number.isInteger(card?.max_model_len) && card.max_model_len > 1 ? card.max_model_len : null;
    ui.model.textContent = card ? card.id + (contextLength ? ` · ${contextLength}-token context` : "") : "no model";
  } catch (e) {
    ui.model.textContent = e.message;
  }
  showReplyLength();
}

function bubble(role, text = "") {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  ui.messages.append(div);
  ui.messages.scrollTop = ui.messages.scrollHeight;
  return div;
}

const utf8 = new TextEncoder();

function estimatedBytes(messages) {
  return messages.reduce((sum, m) => sum + utf8.encode(m.content).length + MESSAGE_OVERHEAD_BYTES,
                         PROMPT_OVERHEAD_BYTES);
}

// The messages a request sends: the system prompt, the turns not left out, and the new user message.
function outgoing(text) {
  const system = ui.system.value.trim();
  return [...(system ? [{ role: "system", content: system }] : []),
          ...conversation.slice(firstSent).map(({ role, content }) => ({ role, content })),
          { role: "user", content: text }];
}

// Leaves the oldest turn still sent (a user message and its reply) out of later requests.
function leaveOutOldestTurn() {
  firstSent = Math.min(firstSent + 2, conversation.length);
  for (const { element } of conversation.slice(0, firstSent)) element.classList.add("left-out");
  const turns = firstSent / 2;
  if (!leftOutNote) {
    leftOutNote = document.createElement("div");
    leftOutNote.className = "note";
    leftOutNote.setAttribute("role", "status");
  }
  leftOutNote.textContent = `${turns} earlier ${turns === 1 ? "turn" : "turns"} left out to fit the model's `
    + (contextLength ? `${contextLength}-token context` : "context");
  conversation[firstSent - 1].element.after(leftOutNote);
}

// Leaves out the oldest turns until the request's estimated prompt leaves `replyTokens` in the context.
function fitContext(text, replyTokens) {
  if (!contextLength) return;
  const budget = contextLength - replyTokens;
  while (firstSent < conversation.length
         && estimatedBytes(outgoing(text)) * tokensPerByte * ESTIMATE_MARGIN > budget) {
    leaveOutOldestTurn();
  }
}

// Yields the JSON payload of each `data:` event until `data: [DONE]`.
async function* serverSentEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function requestBody(messages, replyTokens) {
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  const temperature = Number.parseFloat(ui.temperature.value);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  if (replyTokens !== null) body.max_tokens = replyTokens;
  return body;
}

// Posts the conversation and `text`, leaving out old turns until the server takes it; returns the
// response and the messages it was for.
async function post(text, signal) {
  let replyTokens = maxTokens();
  for (;;) {
    fitContext(text, replyTokens ?? 1);
    const messages = outgoing(text);
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages, replyTokens)), signal,
    });
    if (response.ok) return { response, messages };
    const error = await errorBody(response);
    if (response.status === 400 && error.code === "context_length_exceeded") {
      if (firstSent < conversation.length) {  // the estimate was short: one turn fewer, and a warier estimate
        leaveOutOldestTurn();
        tokensPerByte *= 1.25;
        continue;
      }
      if (error.param === "max_tokens" && replyTokens !== null) {  // the prompt fits: reply in what is left
        replyTokens = null;
        continue;
      }
    }
    throw new Error(error.message);
  }
}

async function send(text) {
  const asked = bubble("user", text);
  const reply = bubble("assistant");
  reply.dataset.state = "streaming";
  const controller = inFlight = new AbortController();
  const started = epoch;
  ui.send.textContent = "Stop";
  const keep = () => {
    if (epoch === started) {
      conversation.push({ role: "user", content: text, element: asked },
                        { role: "assistant", content: reply.textContent, element: reply });
    }
  };
  try {
    const { response, messages } = await post(text, controller.signal);
    for await (const chunk of serverSentEvents(response.body)) {
      controller.signal.throwIfAborted();  // "Stop" ends the reply at once, even mid-way through a buffered read
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        reply.textContent += delta;
        ui.messages.scrollTop = ui.messages.scrollHeight;
      }
      const promptTokens = chunk.usage?.prompt_tokens;
      if (Number.isInteger(promptTokens) && promptTokens > 0) tokensPerByte = promptTokens / estimatedBytes(messages);
    }
    keep();
    reply.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {  // stopped: what came of the reply is part of the conversation
      keep();
      reply.dataset.state = "stopped";
    } else {
      reply.classList.add("error");
      reply.textContent = reply.textContent ? `${reply.textContent}\n[${e.message}]` : e.message;
      reply.dataset.state = "error";
    }
  } finally {
    if (inFlight === controller) {
      inFlight = null;
      ui.send.textContent = "Send";
    }
  }
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  if (inFlight) {  // the button reads "Stop" while a reply streams
    inFlight.abort();
    return;
  }
  const text = ui.prompt.value.trim();
  if (!text) return;
  ui.prompt.value = "";
  send(text);
});

ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});

ui.clear.addEventListener("click", () => {
  epoch += 1;
  inFlight?.abort();
  conversation.length = 0;
  firstSent = 0;
  leftOutNote = null;
  ui.messages.replaceChildren();
});

ui.maxTokens.addEventListener("input", () => {  // the user's own reply length stays; an emptied field is the default
  if (ui.maxTokens.value.trim()) ui.maxTokens.dataset.edited = "yes";
  else delete ui.maxTokens.dataset.edited;
});

ui.apiKey.value = sessionStorage.getItem("meshlm-api-key") ?? "";
ui.apiKey.addEventListener("change", () => {
  sessionStorage.setItem("meshlm-api-key", ui.apiKey.value.trim());
  showModel();
});
showReplyLength();
showModel();
