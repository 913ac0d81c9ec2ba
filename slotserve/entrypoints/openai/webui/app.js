// The slotserve page: a chat through the server's own /v1/chat/completions (SSE) and a live
// view of GET /v1/engine/state. Conversations stay in this browser (localStorage), the API
// key in this tab (sessionStorage). Model text is only ever set as textContent.
"use strict";

const $ = (sel) => document.querySelector(sel);
const KEY_STORE = "slotserve.apiKey";
const CONV_STORE = "slotserve.conversations";
const POLL_MS = 1000;
const HISTORY = 300;  // samples kept for the chart: five minutes at one a second
const MIN_SPAN = 30;  // the chart spans at least this many samples while history is short

const needsKey = document.querySelector('meta[name="slotserve-auth"]').content === "key";
let apiKey = sessionStorage.getItem(KEY_STORE) || "";
let keyPrompt = null;

function askKey() {
  // One dialog however many requests were refused; each waits for the same answer.
  if (!keyPrompt) {
    keyPrompt = new Promise((resolve) => {
      const dlg = $("#keydlg");
      dlg.addEventListener("close", () => {
        apiKey = $("#key").value.trim();
        sessionStorage.setItem(KEY_STORE, apiKey);
        keyPrompt = null;
        resolve();
      }, { once: true });
      dlg.showModal();
    });
  }
  return keyPrompt;
}

async function api(path, opts = {}) {
  if (needsKey && !apiKey) await askKey();
  const headers = Object.assign({ "Content-Type": "application/json" }, opts.headers);
  if (apiKey) headers.Authorization = "Bearer " + apiKey;
  const r = await fetch(path, Object.assign({}, opts, { headers }));
  if (r.status === 401) {
    await askKey();
    return api(path, opts);
  }
  return r;
}

async function errorText(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || r.statusText;
  } catch (_) {
    return r.status + " " + r.statusText;
  }
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function showError(id, text) {
  const box = $(id);
  box.textContent = text || "";
  box.hidden = !text;
}

// ----- tabs and models --------------------------------------------------------------------

function showView(name) {
  for (const t of document.querySelectorAll(".tab")) {
    t.classList.toggle("active", t.dataset.view === name);
  }
  for (const v of document.querySelectorAll(".view")) {
    v.classList.toggle("active", v.id === "view-" + name);
  }
  if (name === "engine") poll();  // fresh at once, not up to a second late
}

async function loadModels() {
  const r = await api("/v1/models");
  if (!r.ok) return showError("#chat-error", await errorText(r));
  const { data } = await r.json();
  const select = $("#model");
  select.replaceChildren(...data.map((m) => el("option", "", m.id)));
}

// ----- conversations ------------------------------------------------------------------------

let convs = JSON.parse(localStorage.getItem(CONV_STORE) || "[]");
let current = null;

function saveConvs() {
  localStorage.setItem(CONV_STORE, JSON.stringify(convs));
}

function newConv() {
  current = { id: Date.now().toString(36), title: "New chat", messages: [] };
  convs.unshift(current);
  saveConvs();
  renderConvs();
  renderMessages();
}

function renderConvs() {
  const items = convs.map((c) => {
    const li = el("li", c === current ? "active" : "");
    const open = el("button", "open", c.title);
    open.addEventListener("click", () => { current = c; renderConvs(); renderMessages(); });
    const del = el("button", "del", "\u00d7");
    del.title = "delete";
    del.addEventListener("click", () => {
      convs = convs.filter((x) => x !== c);
      saveConvs();
      if (current === c) convs.length ? (current = convs[0]) : newConv();
      renderConvs();
      renderMessages();
    });
    li.append(open, del);
    return li;
  });
  $("#conv-list").replaceChildren(...items);
}

function messageNode(m) {
  const div = el("div", "msg " + m.role);
  div.append(el("div", "text", m.content));
  if (m.stats) div.append(el("div", "reply-stats", m.stats));
  return div;
}

function renderMessages() {
  const box = $("#messages");
  box.replaceChildren(...current.messages.map(messageNode));
  if (box.lastElementChild) box.lastElementChild.scrollIntoView({ block: "end" });
}

// ----- chat ---------------------------------------------------------------------------------

let controller = null;
let replyId = null;  // the response id of the reply streaming now: its slot is marked

function requestBody(messages) {
  const system = $("#system").value.trim();
  const body = {
    model: $("#model").value,
    messages: (system ? [{ role: "system", content: system }] : []).concat(
      messages.map((m) => ({ role: m.role, content: m.content }))),
    stream: true,
    stream_options: { include_usage: true },
    temperature: parseFloat($("#temperature").value),
    top_p: parseFloat($("#top_p").value),
    max_tokens: parseInt($("#max_tokens").value, 10),
  };
  if ($("#ignore_eos").checked) body.ignore_eos = true;  // slotserve's (and vLLM's) extension
  const schema = $("#schema").value.trim();
  if (schema) {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "reply", schema: JSON.parse(schema), strict: true },
    };
  }
  return body;
}

// The SSE events of a response body, one parsed `data:` payload at a time.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function replyStats(tokens, approx, t0, tFirst, tEnd, schemaUsed, text) {
  const gen = tFirst ? (tEnd - tFirst) / 1000 : 0;
  const rate = gen > 0 && tokens > 1 ? ((tokens - 1) / gen).toFixed(1) : "-";
  let s = `${approx ? "~" : ""}${tokens} tokens \u00b7 ${rate} tok/s \u00b7 first token ` +
    `${tFirst ? ((tFirst - t0) / 1000).toFixed(2) : "-"} s`;
  if (schemaUsed) {
    try { JSON.parse(text); s += " \u00b7 valid JSON"; } catch (_) { s += " \u00b7 not JSON"; }
  }
  return s;
}

async function send(text) {
  showError("#chat-error", "");
  let body;
  const conv = current;
  conv.messages.push({ role: "user", content: text });
  try {
    body = requestBody(conv.messages);
  } catch (e) {
    conv.messages.pop();
    return showError("#chat-error", "The JSON schema is not valid JSON: " + e.message);
  }
  if (conv.title === "New chat") conv.title = text.slice(0, 40);
  const reply = { role: "assistant", content: "" };
  conv.messages.push(reply);
  saveConvs();
  renderConvs();
  renderMessages();
  $("#messages").lastElementChild.classList.add("streaming");
  // The reply's node, while its conversation is the one shown (another may be opened).
  const node = () => (current === conv ? $("#messages").lastElementChild : null);
  controller = new AbortController();
  $("#send").disabled = true;
  $("#stop").disabled = false;
  const t0 = performance.now();
  let tFirst = 0, chunks = 0, usage = null, error = "";
  try {
    const r = await api("/v1/chat/completions",
      { method: "POST", body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) throw new Error(await errorText(r));
    for await (const ev of sseEvents(r)) {
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) usage = ev.usage;
      if (ev.id) replyId = ev.id;
      const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
      if (delta && delta.content) {
        if (!tFirst) tFirst = performance.now();
        chunks += 1;
        reply.content += delta.content;
        const n = node();
        if (n) {
          n.querySelector(".text").textContent = reply.content;
          n.scrollIntoView({ block: "end" });
        }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") error = e.message;
  }
  const tokens = usage ? usage.completion_tokens : chunks;
  reply.stats = replyStats(tokens, !usage, t0, tFirst, performance.now(),
    "response_format" in body, reply.content) + (error ? " \u00b7 error" : "") +
    (controller.signal.aborted ? " \u00b7 stopped" : "");
  controller = null;
  replyId = null;
  if (node()) renderMessages();
  $("#send").disabled = false;
  $("#stop").disabled = true;
  showError("#chat-error", error);
  saveConvs();
}

// ----- engine view ------------------------------------------------------------------------

const samples = [];       // {t, toks, kv, pre}
const lastHolder = {};    // slot index -> the last request id seen holding it
let prev = null;

function renderSlots(state) {
  const cells = state.slots.map((s) => {
    if (s.request_id) lastHolder[s.index] = s.request_id;
    const cell = el("div", "slot s-" + s.status);
    cell.dataset.status = s.status;
    cell.dataset.index = s.index;
    cell.append(el("b", "", "#" + s.index), el("span", "st", s.status));
    if (s.request_id) {
      // The engine runs a chat reply under its response id (choice i of n > 1: "i_" + id).
      if (replyId && (s.request_id === replyId || s.request_id.endsWith("_" + replyId))) {
        cell.classList.add("mine");
        cell.append(el("span", "you", "this chat"));
      }
      cell.append(el("span", "rid", s.request_id));
      cell.title = s.request_id;
      if (s.num_tokens !== null) cell.append(el("span", "tok", s.num_tokens + " tok"));
    } else if (lastHolder[s.index]) {
      cell.append(el("span", "rid last", "last: " + lastHolder[s.index]));
    }
    return cell;
  });
  $("#slots").replaceChildren(...cells);
}

function renderClients(adm) {
  const rows = adm.clients.map((c) => {
    const tr = el("tr");
    const share = `${c.in_engine_seqs} / ${adm.client_max_slots}`;
    for (const v of [c.client, c.queued, c.waiting_seqs + " / " + adm.client_max_seqs, share]) {
      tr.append(el("td", "", String(v)));
    }
    return tr;
  });
  if (!rows.length) rows.push(el("tr", "empty", "no client is waiting or running"));
  $("#clients tbody").replaceChildren(...rows);
}

function renderEngine(state, toks) {
  const held = state.slots.filter((s) => s.status !== "free").length;
  $("#m-slots").textContent = `${held} / ${state.max_num_seqs}`;
  $("#m-kv").textContent =
    `${state.num_blocks_used} / ${state.num_blocks_cached} / ${state.num_blocks_free}`;
  $("#m-waiting").textContent = `${state.num_waiting} / ${state.admission.queued}`;
  $("#m-grammar").textContent = state.num_waiting_for_grammar;
  $("#m-preempt").textContent = state.num_preemptions;
  $("#m-toks").textContent = toks.toFixed(1);
  const pct = (n) => (100 * n / Math.max(1, state.num_blocks)) + "%";
  $("#kvbar .used").style.width = pct(state.num_blocks_used);
  $("#kvbar .cached").style.width = pct(state.num_blocks_cached);
  $("#engine-age").textContent = `step ${state.num_steps}`;
  renderSlots(state);
  renderClients(state.admission);
  drawChart();
}

let polling = false;

async function poll() {
  if (document.hidden || polling) return;  // a slow answer is not asked for twice
  polling = true;
  let state;
  try {
    const r = await api("/v1/engine/state");
    if (!r.ok) return showError("#engine-error", await errorText(r));
    state = await r.json();
  } catch (e) {
    return showError("#engine-error", "the server does not answer: " + e.message);
  } finally {
    polling = false;
  }
  showError("#engine-error", "");
  // A sample per second or more: an extra poll (the tab opened) is drawn but not charted,
  // so the rate is never taken over a few milliseconds.
  if (!prev || state.time - prev.time >= 0.5) {
    const dt = prev ? state.time - prev.time : 0;
    samples.push({
      t: state.time,
      toks: dt ? (state.generation_tokens_total - prev.generation_tokens_total) / dt : 0,
      kv: state.num_blocks_used / Math.max(1, state.num_blocks),
      pre: prev ? state.num_preemptions - prev.num_preemptions : 0,
    });
    if (samples.length > HISTORY) samples.shift();
    prev = state;
  }
  renderEngine(state, samples[samples.length - 1].toks);
}

function drawChart() {
  const canvas = $("#chart");
  if (!canvas.offsetParent) return;  // not shown
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr;
  canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const pad = 28, right = w - 34, bottom = h - 18;
  const maxToks = Math.max(10, ...samples.map((s) => s.toks));
  const span = Math.max(MIN_SPAN, samples.length);
  const x = (i) => pad + (right - pad) * (i + span - samples.length) / (span - 1);
  g.strokeStyle = "#ccc";
  g.fillStyle = "#666";
  g.font = "11px sans-serif";
  g.strokeRect(pad, 6, right - pad, bottom - 6);
  g.fillText(maxToks.toFixed(0), 2, 14);
  g.fillText("0", 2, bottom);
  g.fillText("100%", right + 3, 14);
  g.fillText(span >= 120 ? `-${Math.round(span / 60)} min` : `-${span} s`, pad, h - 4);
  g.fillText("now", right - 20, h - 4);
  samples.forEach((s, i) => {  // preemptions: a red tick for each second that had any
    if (!s.pre) return;
    g.fillStyle = "#d33";
    g.fillRect(x(i) - 1, bottom - Math.min(bottom - 6, 6 + 4 * s.pre), 3, 6 + 4 * s.pre);
  });
  const line = (color, value) => {
    g.strokeStyle = color;
    g.lineWidth = 1.5;
    g.beginPath();
    samples.forEach((s, i) => {
      const y = bottom - (bottom - 6) * value(s);
      i ? g.lineTo(x(i), y) : g.moveTo(x(i), y);
    });
    g.stroke();
  };
  line("#2a7", (s) => s.kv);
  line("#36c", (s) => s.toks / maxToks);
}

// ----- start --------------------------------------------------------------------------------

function start() {
  for (const t of document.querySelectorAll(".tab")) {
    t.addEventListener("click", () => showView(t.dataset.view));
  }
  $("#new-chat").addEventListener("click", newConv);
  $("#composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("#prompt").value.trim();
    if (!text || controller) return;
    $("#prompt").value = "";
    send(text);
  });
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("#composer").requestSubmit();
    }
  });
  $("#stop").addEventListener("click", () => controller && controller.abort());
  window.addEventListener("resize", drawChart);
  if (convs.length) {
    current = convs[0];
    renderConvs();
    renderMessages();
  } else {
    newConv();
  }
  loadModels();
  poll();
  setInterval(poll, POLL_MS);
}

start();
