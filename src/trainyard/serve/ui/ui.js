// The demo page: GET metadata for the model's identity, GET card?format=json for its model
// card (when /metadata names one), POST classify for a dropped image.
// Plain browser JavaScript, no build step. URLs are relative to the page (/ui), so the
// page also works when the service sits behind a path prefix.
"use strict";

const $ = (id) => document.getElementById(id);
let apiKey = "";
let lastFile = null;

function headers() {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

// The API's own message for a refused request ({"error": ..., "field": ...}).
async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error) {
      return body.field ? `${body.error} (field: ${body.field})` : body.error;
    }
  } catch (_) {
    // not JSON: fall through to the status line
  }
  return `HTTP ${resp.status} ${resp.statusText}`.trim();
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function setStatus(message) {
  $("status").textContent = message;
}

function askForKey(message) {
  $("key-row").hidden = false;
  showError(message);
  $("api-key").focus();
}

function row(term, value) {
  const dt = document.createElement("dt");
  dt.textContent = term;
  const dd = document.createElement("dd");
  dd.textContent = value === undefined || value === null || value === "" ? "—" : String(value);
  dd.dataset.field = term;
  return [dt, dd];
}

function showCard(meta) {
  const model = meta.model || {};
  const input = meta.input || {};
  const source = meta.source || {};
  const registry = source.registry_version
    ? `${source.registry_model} v${source.registry_version}` +
      (source.registry_alias ? ` (@${source.registry_alias})` : "")
    : "local file";
  const rows = [
    row("model version", model.version),
    row("architecture", model.arch),
    row("MLflow run", source.mlflow_run_id || model.mlflow_run_id),
    row("data version", source.data_version || model.data_sha256),
    row("registry", registry),
    row("input size", input.image),
    row("resize policy", input.resize),
    row("image formats", (input.image_formats || []).join(", ")),
    row("provider", meta.provider),
  ];
  $("card").replaceChildren(...rows.flat());
  $("classes").replaceChildren(
    ...(meta.classes || []).map((name) => {
      const li = document.createElement("li");
      li.textContent = name;
      return li;
    }),
  );
  const topK = $("top-k");
  topK.max = String((meta.classes || []).length || 1);
  if (input.top_k) topK.value = String(input.top_k);
  loadModelCard(meta.card);
}

// An element with text, and a table of rows of text: the card holds class names and
// numbers only, always set as text (never as HTML).
function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function table(head, rows) {
  const t = el("table");
  const tr = el("tr");
  tr.append(...head.map((h) => el("th", h)));
  const body = el("tbody");
  body.append(...rows.map((r) => {
    const row = el("tr");
    row.append(...r.map((v) => el("td", v === null || v === undefined ? "—" : String(v))));
    return row;
  }));
  const thead = el("thead");
  thead.append(tr);
  t.append(thead, body);
  return t;
}

const num = (x, digits) => (typeof x === "number" ? x.toFixed(digits) : "—");
const pct = (x) => (typeof x === "number" ? `${(100 * x).toFixed(1)}%` : "—");

function qualityRows(q) {
  const cal = q.calibration || {};
  const rows = [
    ["test accuracy", `${num(q.test.accuracy, 4)} on ${q.test.samples} images`],
    ["macro F1", num(q.test.macro_f1, 4)],
    ["calibration error (ECE)",
      `${num(cal.ece, 4)} at temperature ${num(cal.temperature, 3)} (${num(cal.ece_uncalibrated, 4)} before)`],
  ];
  if (q.explain) {
    const e = q.explain;
    rows.push(["heatmap deletion test", `${e.passed ? "passed" : "failed"}: top 20% ` +
      `-${pct(e.deletion_drop_top20)}, random 20% -${pct(e.deletion_drop_random20)}`]);
    if (typeof e.occlusion_ceiling_ratio === "number") {  // cards from before the ceiling lack it
      rows.push(["best map at its grid (occlusion ceiling)", `the map ${num(e.occlusion_map_ratio, 2)}x, ` +
        `the ceiling ${num(e.occlusion_ceiling_ratio, 2)}x at ${e.occlusion_grid} on ${e.occlusion_samples} images`]);
    }
  }
  if (q.int8) rows.push(["int8 agreement", `${pct(q.int8.agreement)} of ${q.int8.samples}`]);
  return rows;
}

function showModelCard(card) {
  const m = card.model || {};
  const q = card.quality || {};
  const d = card.data || {};
  const w = card.weak || {};
  const reg = card.registry;
  const weights = m.weights
    ? `${m.weights.source} (licence: ${m.weights.license})`
    : "trained from scratch";
  const splits = ["train", "val", "test"].filter((s) => (d.counts || {})[s]);
  const links = el("p", "", "card-links");
  const md = el("a", "the whole card (Markdown)");
  md.href = "card";
  const json = el("a", "JSON");
  json.href = "card?format=json";
  links.append(md, " · ", json);
  $("model-card").replaceChildren(
    el("h3", "How good it is"),
    table(["", ""], qualityRows(q)),
    table(["class", "precision", "recall", "F1", "test images"], (q.per_class || []).map(
      (r) => [r.class, num(r.precision, 3), num(r.recall, 3), num(r.f1, 3), r.support],
    )),
    el("h3", "Where it is weak"),
    table(["true class", "taken for", "images", "share"], (w.confused_pairs || []).map(
      (p) => [p.true, p.predicted, p.images, pct(p.share_of_true)],
    )),
    el("h3", "What it learned from"),
    el("p", `${d.source}, DVC data version ${d.data_version || "—"}, git commit ` +
      `${(d.git_commit || "").slice(0, 12) || "—"}`),
    table(["class", ...splits], (d.classes || []).map(
      (c) => [c, ...splits.map((s) => ((d.counts[s] || {}).per_class || {})[c])],
    )),
    el("h3", "What the model is"),
    table(["", ""], [
      ["architecture", m.arch],
      ["weights", weights],
      ["registry", reg
        ? `${reg.model} v${reg.version} (${reg.alias_at_registration} at registration)`
        : "not registered"],
    ]),
    links,
  );
}

async function loadModelCard(url) {
  const box = $("model-card");
  if (!url) {
    box.replaceChildren(el("p", "no card for this model", "no-card"));
    return;
  }
  let resp;
  try {
    resp = await fetch("card?format=json", { headers: headers() });
  } catch (err) {
    box.replaceChildren(el("p", `GET /card failed: ${err.message}`, "no-card"));
    return;
  }
  if (!resp.ok) {
    const why = resp.status === 404 ? "no card for this model" : await errorText(resp);
    box.replaceChildren(el("p", why, "no-card"));
    return;
  }
  showModelCard(await resp.json());
}

// A model exported before its class activation maps cannot explain: no toggle to fail.
function offerExplain(method) {
  const explain = $("explain");
  explain.disabled = !method;
  if (!method) explain.checked = false;
  $("explain-label").title = method
    ? `overlay where the model looked for its top label (${method}, POST /classify?explain=1)`
    : "this model was exported without its class activation maps: it cannot explain";
}

async function loadMetadata() {
  let resp;
  try {
    resp = await fetch("metadata", { headers: headers() });
  } catch (err) {
    showError(`GET /metadata failed: ${err.message}`);
    return;
  }
  if (resp.status === 401) {
    askForKey(await errorText(resp));
    return;
  }
  if (!resp.ok) {
    showError(await errorText(resp));
    return;
  }
  showError("");
  const meta = await resp.json();
  showCard(meta);
  offerExplain(meta.explain);
}

function showResults(pred) {
  const bars = pred.top_k.map((item) => {
    const li = document.createElement("li");
    li.className = "bar";
    li.dataset.label = item.label;
    li.dataset.classId = String(item.class_id);
    li.dataset.probability = String(item.probability);
    const name = document.createElement("span");
    name.className = "label";
    name.textContent = item.label;
    const track = document.createElement("span");
    track.className = "track";
    const fill = document.createElement("span");
    fill.className = "fill";
    fill.style.width = `${(item.probability * 100).toFixed(2)}%`;
    track.append(fill);
    const value = document.createElement("span");
    value.className = "probability";
    value.textContent = `${(item.probability * 100).toFixed(1)}%`;
    li.append(name, track, value);
    return li;
  });
  $("results").replaceChildren(...bars);
  setStatus(`${pred.label} (model ${pred.model_version})`);
  if (pred.heatmap) showHeatmap(pred.heatmap);
}

// The answer's heatmap: a PNG with alpha, the size of the upload, coloured where the model looked
// for its top label and transparent elsewhere, laid on the preview.
function showHeatmap(base64Png) {
  const img = $("heatmap");
  img.onload = () => { img.hidden = false; };
  img.src = `data:image/png;base64,${base64Png}`;
}

function preview(file) {
  const img = $("preview");
  if (img.src) URL.revokeObjectURL(img.src);
  img.hidden = false;
  img.onerror = () => { img.hidden = true; };
  img.src = URL.createObjectURL(file);
  $("drop-text").textContent = `${file.name}: drop another, or browse`;
}

async function classify(file) {
  if (!file) return;
  lastFile = file;
  preview(file);
  showError("");
  $("results").replaceChildren();
  $("heatmap").hidden = true;
  setStatus("classifying…");
  const query = new URLSearchParams({ top_k: $("top-k").value || "5" });
  if ($("invert").checked) query.set("invert", "true");
  if ($("explain").checked) query.set("explain", "1");
  const form = new FormData();
  form.append("image", file, file.name);
  let resp;
  try {
    resp = await fetch(`classify?${query}`, { method: "POST", body: form, headers: headers() });
  } catch (err) {
    setStatus("");
    showError(`POST /classify failed: ${err.message}`);
    return;
  }
  setStatus("");
  if (resp.status === 401) {
    askForKey(await errorText(resp));
  } else if (!resp.ok) {
    showError(await errorText(resp));
  } else {
    showResults(await resp.json());
  }
}

function setUp() {
  const drop = $("drop");
  $("file").addEventListener("change", (event) => classify(event.target.files[0]));
  for (const name of ["dragenter", "dragover"]) {
    drop.addEventListener(name, (event) => {
      event.preventDefault();
      drop.classList.add("over");
    });
  }
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    classify(event.dataTransfer.files[0]);
  });
  const useKey = () => {
    apiKey = $("api-key").value.trim();
    loadMetadata().then(() => classify(lastFile));
  };
  $("key-apply").addEventListener("click", useKey);
  $("api-key").addEventListener("keydown", (event) => {
    if (event.key === "Enter") useKey();
  });
  for (const id of ["top-k", "invert", "explain"]) {
    $(id).addEventListener("change", () => classify(lastFile));
  }
  loadMetadata();
}

setUp();
