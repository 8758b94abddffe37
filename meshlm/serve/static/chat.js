// The chat page: keeps the conversation here, sends all of it to /v1/chat/completions with
// "stream": true, and shows the reply as its server-sent events arrive.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"), composer: $("composer"), prompt: $("prompt"), send: $("send"), model: $("model"),
  apiKey: $("api-key"), temperature: $("temperature"), maxTokens: $("max-tokens"), system: $("system"), clear: $("clear"),
};
const conversation = [];  // {role, content} of every finished turn
let inFlight = null;       // the AbortController of the reply being streamed

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function showModel() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorMessage(response));
    const { data } = await response.json();
    ui.model.textContent = data[0]?.id ?? "no model";
  } catch (e) {
    ui.model.textContent = e.message;
  }
}

function bubble(role, text = "") {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  ui.messages.append(div);
  ui.messages.scrollTop = ui.messages.scrollHeight;
  return div;
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

function requestBody(messages) {
  const body = { messages, stream: true };
  const temperature = Number.parseFloat(ui.temperature.value);
  const maxTokens = Number.parseInt(ui.maxTokens.value, 10);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  if (Number.isInteger(maxTokens)) body.max_tokens = maxTokens;
  return body;
}

async function send(text) {
  bubble("user", text);
  const reply = bubble("assistant");
  reply.dataset.state = "streaming";
  const system = ui.system.value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...conversation,
                    { role: "user", content: text }];
  inFlight = new AbortController();
  ui.send.textContent = "Stop";
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages)), signal: inFlight.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of serverSentEvents(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        reply.textContent += delta;
        ui.messages.scrollTop = ui.messages.scrollHeight;
      }
    }
    conversation.push({ role: "user", content: text }, { role: "assistant", content: reply.textContent });
    reply.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      reply.dataset.state = "stopped";
    } else {
      reply.classList.add("error");
      reply.textContent = reply.textContent ? `${reply.textContent}\n[${e.message}]` : e.message;
      reply.dataset.state = "error";
    }
  } finally {
    inFlight = null;
    ui.send.textContent = "Send";
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
  inFlight?.abort();
  conversation.length = 0;
  ui.messages.replaceChildren();
});

ui.apiKey.value = sessionStorage.getItem("meshlm-api-key") ?? "";
ui.apiKey.addEventListener("change", () => {
  sessionStorage.setItem("meshlm-api-key", ui.apiKey.value.trim());
  showModel();
});
showModel();
