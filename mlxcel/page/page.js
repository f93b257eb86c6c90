// mlxcel's page: polls the server's JSON endpoints and draws them. Every value is put in the page as text
// (textContent, attributes), never as markup: model names come from directory names.
"use strict";

const KEY_STORE = "mlxcel-api-key"; // sessionStorage: this tab only
const POLL_MS = 2000;
const FETCH_MS = 10000; // a request that takes longer is given up (the next poll asks again)
const SVG_NS = "http://www.w3.org/2000/svg";
const KINDS = { 400: "bad request", 401: "no valid key", 404: "no such route or model", 405: "wrong method",
  408: "too slow", 413: "too large", 422: "unprocessable", 429: "too many requests", 500: "server error",
  503: "unavailable", 504: "timed out" };

let key = sessionStorage.getItem(KEY_STORE);
let model = null; // a server of several models: the one whose policy and status are shown
const samples = []; // profiling samples seen: {samples, acceptance, speedup}

class KeyNeeded extends Error {}

const $ = (id) => document.getElementById(id);

function el(tag, text) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = String(text);
  return node;
}

async function api(path, loading = false) {
  // *loading*: a 503 is an answer too (/health's while the model loads).
  const headers = key ? { Authorization: "Bearer " + key } : {};
  const response = await fetch(path, { headers, cache: "no-store", signal: AbortSignal.timeout(FETCH_MS) });
  if (response.status === 401) throw new KeyNeeded(path);
  if (!response.ok && !(loading && response.status === 503)) {
    throw new Error(path + " answered HTTP " + response.status);
  }
  return response.json();
}

function withModel(path, name) {
  // Always named: on a server of several models, a status route without ?model= is the default model's, and
  // asking it of a default that is not loaded would load it.
  return name ? path + "?model=" + encodeURIComponent(name) : path;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function shown(value) {
  return value === null || value === undefined ? "–" : String(value);
}

function fixed(value, digits, suffix) {
  return value === null || value === undefined ? null : value.toFixed(digits) + (suffix || "");
}

function facts(list, pairs) {
  list.replaceChildren(...pairs.flatMap(([name, value]) => [el("dt", name), el("dd", shown(value))]));
}

function table(node, head, rows) {
  const header = el("tr");
  header.append(...head.map((name) => el("th", name)));
  node.replaceChildren(header, ...rows.map((cells) => {
    const row = el("tr");
    row.append(...cells.map((cell) => el("td", shown(cell))));
    return row;
  }));
}

function svg(tag, attributes) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}

function plot(box, values, ceiling) {
  // A line of *values* across the box, 0 at the bottom, *ceiling* (or the largest) at the top; with a ceiling,
  // a dot per value and a dashed line at 1.0 (an estimated speedup of one: the burst neither wins nor loses).
  const top = Math.max(ceiling || 0, ...values, 1e-9);
  const x = (i) => (values.length > 1 ? (i * 588) / (values.length - 1) + 6 : 300).toFixed(1);
  const y = (v) => (84 - (v / top) * 78).toFixed(1);
  const parts = [svg("polyline", { class: "line", points: values.map((v, i) => x(i) + "," + y(v)).join(" ") })];
  if (ceiling) {
    parts.push(svg("line", { class: "one", x1: 0, x2: 600, y1: y(1), y2: y(1) }));
    values.forEach((v, i) => parts.push(svg("circle", { class: "dot", cx: x(i), cy: y(v), r: 3 })));
  }
  box.replaceChildren(...parts);
}

// -- the key ---------------------------------------------------------------------------------------------

function askForKey(refused) {
  $("key-form").hidden = false;
  $("key-error").textContent = refused ? "The server refused this key." : "";
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  key = $("key-input").value.trim() || null;
  if (key) sessionStorage.setItem(KEY_STORE, key); else sessionStorage.removeItem(KEY_STORE);
  $("key-form").hidden = true;
  poll();
});

// -- the policy ------------------------------------------------------------------------------------------

async function loadStatechart() {
  const text = await (await fetch("/page/statechart.svg")).text();
  const svg = new DOMParser().parseFromString(text, "image/svg+xml").documentElement;
  $("statechart").replaceChildren(document.importNode(svg, true));
}

function showPolicy(policy) {
  const leaf = policy.state === "unavailable" ? "unavailable/" + policy.reason : policy.state;
  document.body.dataset.policyState = leaf;
  for (const node of $("statechart").querySelectorAll("[data-state]")) {
    const name = node.getAttribute("data-state");
    node.classList.toggle("current", name === leaf || name === policy.state);
  }
  const pairing = [policy.target, policy.drafter, policy.hardware, policy.block_size].every((v) => v === null)
    ? null : [policy.target, policy.drafter, policy.hardware, "K=" + policy.block_size].join(" · ");
  facts($("policy-facts"), [
    ["State", policy.reason ? policy.state + " (" + policy.reason + ")" : policy.state],
    ...(policy.decline_detail ? [["Why declined", policy.decline_detail]] : []),
    ["Verdict", policy.verdict],
    ["MTP burst", policy.mtp_enabled === null ? null : policy.mtp_enabled ? "on" : "off"],
    ["Pairing", pairing],
    ["Acceptance", fixed(policy.acceptance_rate, 2)],
    ["Estimated speedup", fixed(policy.estimated_speedup, 2, "x")],
    ["Depth limit", policy.depth_limit === null ? null : policy.depth_limit + " tokens"],
    ["Samples", policy.samples + " of " + policy.samples_required],
  ]);
  showSamples(policy);
  showBatch(policy.batch);
}

function showSamples(policy) {
  if (policy.state !== "profiling" && policy.state !== "settled") samples.length = 0;
  const last = samples[samples.length - 1];
  if (policy.samples > 0 && (!last || last.samples !== policy.samples)) {
    samples.push({ samples: policy.samples, acceptance: policy.acceptance_rate, speedup: policy.estimated_speedup });
  }
  $("samples-block").hidden = samples.length === 0 && policy.state !== "profiling";
  $("samples-progress").max = policy.samples_required;
  $("samples-progress").value = policy.samples;
  table($("samples-table"), ["Sample", "Acceptance", "Estimated speedup"],
    samples.map((s) => [s.samples, fixed(s.acceptance, 2), fixed(s.speedup, 2, "x")]));
  plot($("samples-plot"), samples.map((s) => s.speedup || 0), 2);
}

function showBatch(batch) {
  $("batch-block").hidden = !batch;
  if (!batch) return;
  const cells = batch.cells || [];
  $("batch-summary").textContent = (!batch.speculates ? "The batch does not speculate: " + shown(batch.reason) + ". "
    : "") + (cells.length ? "What the rule of K runs now, by width (1: a request alone, its burst round by round; "
      + "more: requests decoding together) and context depth:"
      : "Nothing measured yet: the rule measures each width and depth as requests run there.");
  const rows = cells.map((c) => [c.width === 1 ? "1 (alone)" : c.width, c.min_depth + "–" + c.max_depth, c.drafts,
    fixed(c.estimated_speedup, 2, "x")]);
  for (const w of batch.inexact_widths || []) rows.push([w.width, "any", "0 (inexact)", w.detail]);
  table($("batch-table"), ["Width", "Depth (tokens)", "Drafts per row", "Estimated speedup"], rows);
}

// -- the server ------------------------------------------------------------------------------------------

function showModels(models) {
  const data = models.data || [];
  table($("models-table"), ["Model", "State", "Holds"], data.map((m) => [m.id,
    m.state || (m.loaded === false ? "not loaded" : "loaded"), m.charged_bytes ? bytes(m.charged_bytes) : null]));
  const picker = $("model-select");
  $("model-picker").hidden = data.length < 2;
  if (data.length > 1 && picker.options.length !== data.length) {
    picker.replaceChildren(...data.map((m) => { const o = el("option", m.id); o.value = m.id; return o; }));
    if (model) picker.value = model;
  }
}

$("model-select").addEventListener("change", (event) => {
  model = event.target.value;
  samples.length = 0;
  poll();
});

function showServer(health, status, cache) {
  const memory = health.memory;
  facts($("server-facts"), [
    ["Running", status.requests.running + " of " + status.requests.slots + " slots"],
    ["Queued", status.requests.queued],
    ["Tokens", status.tokens.prompt + " prompt, " + status.tokens.generated + " generated"],
    ["Drafts", status.tokens.drafted + " proposed, " + status.tokens.accepted + " accepted"],
    ["Memory", memory ? bytes(memory.charged + memory.reserved) + " of " + bytes(memory.budget) +
      " budget (" + bytes(memory.free) + " free)" : "no budget set"],
    ["BLAS", health.observability ? health.observability.blas : null],
    ["Up", Math.round(status.uptime_seconds) + " s"],
  ]);
  const spans = status.generated_by_span;
  const rate = spans.counts.map((count, i) => count / (i === spans.counts.length - 1
    ? Math.max(spans.current_span_seconds, 1) : spans.span_seconds));
  $("rate-now").textContent = "now " + rate[rate.length - 1].toFixed(1) + " tokens/s, each point " +
    spans.span_seconds + " s";
  plot($("rate-plot"), rate, 0);
  const disk = cache.disk || {};
  facts($("cache-facts"), [
    ["Entries", cache.max_entries ? cache.entries + " of " + cache.max_entries : cache.entries],
    ["Held", bytes(cache.bytes) + " of " + bytes(cache.max_bytes)],
    ["Hit rate", cache.hit_rate === null ? null : Math.round(cache.hit_rate * 100) + "% of " + cache.lookups + " prompts"],
    ["Tokens from cache", cache.reused_tokens + " of " + cache.prompt_tokens],
    ["Disk tier", disk.max_bytes ? disk.entries + " entries, " + bytes(disk.bytes) + " of " + bytes(disk.max_bytes) +
      ", " + disk.hits + " hits" : "off"],
  ]);
  table($("errors-table"), ["When", "Route", "Status"], status.errors.map((e) =>
    [new Date(e.at * 1000).toLocaleTimeString(), e.route, e.status + (KINDS[e.status] ? " " + KINDS[e.status] : "")]));
}

function showUnloaded(chosen) {
  facts($("server-facts"), [["Model", chosen.id + " is " + (chosen.state || "not loaded") +
    ": it loads when a request names it"]]);
  $("rate-now").textContent = "";
  $("rate-plot").replaceChildren();
  facts($("cache-facts"), []);
  table($("errors-table"), ["When", "Route", "Status"], []);
}

// -- the router ------------------------------------------------------------------------------------------

function showRouter(health, stats) {
  facts($("router-facts"), [["Status", health.status], ["Nodes", health.healthy_nodes + " of " + health.nodes + " healthy"],
    ["Placement", stats.placement], ["Rerouted", stats.rerouted], ["Rejected", stats.rejected]]);
  table($("nodes-table"), ["Node", "Healthy", "In flight", "Served", "Failed", "Policy", "Verdict", "Burst"],
    stats.nodes.map((n) => [n.id, n.healthy ? "yes" : "no", n.in_flight, n.served, n.failed, n.policy_state,
      n.verdict, n.runs_burst ? "on" : "off"]));
}

// -- polling ---------------------------------------------------------------------------------------------

let timer = null;
let round = 0; // the latest poll: an older one that ends after a newer began draws nothing

async function poll() {
  clearTimeout(timer);
  const mine = ++round;
  const current = () => mine === round;
  try {
    const health = await api("/health", true);
    if (!current()) return;
    $("server-name").textContent = health.model || (health.role === "router" ? "router" : "");
    $("server-status").textContent = health.status;
    $("server-status").className = "badge " + (health.status === "ok" ? "ok" : "bad");
    // What a start is doing (its last progress line: the weights, the exactness probes), while it loads.
    $("server-loading").textContent = health.loading || "";
    $("server-loading").hidden = !health.loading;
    if (health.role === "router") {
      const stats = await api("/router/stats");
      if (!current()) return;
      showRouter(health, stats);
      $("router-section").hidden = false;
    } else {
      const models = await api("/v1/models");
      const name = model || health.model;
      const chosen = (models.data || []).find((m) => m.id === name);
      const unloaded = chosen !== undefined && chosen.loaded === false;
      // A model not loaded has no status (it loads when a request names it): only its policy is asked for.
      const [policy, status, cache] = await Promise.all([api(withModel("/v1/internal/mtp-policy", name)),
        unloaded ? null : api(withModel("/v1/internal/server-status", name)),
        unloaded ? null : api(withModel("/v1/cache/stats", name))]);
      if (!current()) return;
      showModels(models);
      showPolicy(policy);
      if (unloaded) showUnloaded(chosen); else showServer(health, status, cache);
      $("policy-section").hidden = false;
      $("server-section").hidden = false;
    }
    $("load-error").hidden = true;
    document.body.dataset.loaded = "yes";
  } catch (error) {
    if (!current()) return;
    if (error instanceof KeyNeeded) {
      askForKey(Boolean(key));
      return; // until a key is given
    }
    $("load-error").textContent = "Cannot read the server: " + error.message;
    $("load-error").hidden = false;
  }
  timer = setTimeout(poll, POLL_MS);
}

loadStatechart().then(poll, (error) => {
  $("load-error").textContent = "Cannot load the statechart: " + error.message;
  $("load-error").hidden = false;
  poll();
});
