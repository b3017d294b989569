// specpilot dashboard: renders /api/dashboard (GetPolicy's JSON and the controller's state),
// follows /api/events (server-sent events) and sends overrides with the policy token.
// No library: plain DOM and SVG.
"use strict";

const HISTORY = 720;        // acceptance samples kept per class (one per tick/decision: ~1 h)
const LOG_PAGE = 100;       // decision-log entries per page
const TIMELINE_EVENTS = 2000;
const COLORS = ["#1a5fb4", "#c01c28", "#26a269", "#e66100", "#813d9c", "#865e3c", "#0b7d8a",
                "#a51d2d", "#5e5c64", "#b5835a"];
const $ = (id) => document.getElementById(id);
const svgNS = "http://www.w3.org/2000/svg";

const view = {
  state: null, instance: null, selected: null, history: new Map(), timeline: [],
  shown: 0, disconnectedSince: null, refreshTimer: null, source: null,
};

// --- helpers ------------------------------------------------------------------------------
function el(tag, attrs = {}, text = "") {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== "") e.textContent = text;
  return e;
}
function svg(tag, attrs = {}) {
  const e = document.createElementNS(svgNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}
const clock = (t) => new Date(t * 1000).toLocaleTimeString();
const reasonName = (r) => String(r || "").replace("DECISION_REASON_", "").toLowerCase();
const scopeName = (s) => String(s || "").replace("OVERRIDE_SCOPE_", "").toLowerCase();
function bucketLabel(b, bounds) {
  const lo = b === 0 ? 1 : bounds[b - 1] + 1;
  return b < bounds.length ? (lo === bounds[b] ? `${lo}` : `${lo}-${bounds[b]}`) : `${lo}+`;
}
function overrideText(o) {
  const what = o.pin_k !== undefined ? `pin K=${o.pin_k}` : o.force_off ? "force off"
    : `force draft ${o.force_draft}`;
  return `${what} (${scopeName(o.scope)}, set by ${o.set_by || "?"} at ${clock(o.set_unix_seconds)}`
    + (o.note ? `: "${o.note}")` : ")");
}
// The read token (dashboard_read_token), where the controller asks for one: opened as
// /#read_token=..., kept for the tab; the policy token is taken too.
const readToken = (() => {
  const given = new URLSearchParams(location.hash.slice(1)).get("read_token");
  if (given !== null) {
    sessionStorage.setItem("specpilot-read-token", given);
    history.replaceState(null, "", location.pathname + location.search);  // off the address bar
  }
  return () => sessionStorage.getItem("specpilot-read-token") || $("token").value.trim();
})();
async function getJSON(url) {
  const token = readToken();
  const headers = token ? {Authorization: `Bearer ${token}`} : {};
  const r = await fetch(url, {cache: "no-store", headers});
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

// --- connection -----------------------------------------------------------------------------
function setConnected(up) {
  const status = $("status");
  if (up) {
    view.disconnectedSince = null;
    $("banner").hidden = true;
    status.textContent = "live";
    status.className = "status up";
  } else {
    if (view.disconnectedSince === null) view.disconnectedSince = Date.now() / 1000;
    const banner = $("banner");
    banner.textContent = `Disconnected from the controller since ${clock(view.disconnectedSince)}`
      + " — retrying; what is shown may be out of date.";
    banner.hidden = false;
    status.textContent = "disconnected";
    status.className = "status down";
  }
}

function connect() {
  if (view.source) view.source.close();
  const token = readToken();
  const source = new EventSource(token ? `/api/events?token=${encodeURIComponent(token)}`
    : "/api/events");
  view.source = source;
  source.addEventListener("hello", async (ev) => {
    const hello = JSON.parse(ev.data);
    const restarted = view.instance !== null && hello.instance !== view.instance;
    view.instance = hello.instance;
    setConnected(true);
    await loadAll(restarted);
  });
  source.addEventListener("decision", (ev) => onDecision(JSON.parse(ev.data)));
  source.addEventListener("audit", (ev) => addAudit(JSON.parse(ev.data)));
  source.addEventListener("tick", (ev) => {
    const tick = JSON.parse(ev.data);
    if (!view.state || String(tick.version) !== String(view.state.policy.version)) scheduleRefresh();
    else refresh();  // report ages and estimates move without a new version
  });
  source.onerror = () => {
    setConnected(false);
    // A stream the browser gave up on (not a plain retry) is reopened by hand.
    if (source.readyState === EventSource.CLOSED) setTimeout(connect, 1000);
  };
}

function scheduleRefresh() {
  if (view.refreshTimer !== null) return;
  view.refreshTimer = setTimeout(() => { view.refreshTimer = null; refresh(); }, 200);
}

async function refresh() {
  try {
    view.state = await getJSON("/api/dashboard");
  } catch (e) {
    return;  // the event stream reports the outage
  }
  sample();
  render();
}

async function loadAll(restarted) {
  if (restarted) { view.history.clear(); view.timeline = []; }
  await refresh();
  await loadLog(true);
  await loadTimeline();
}

// --- state ----------------------------------------------------------------------------------
function sample() {
  const at = view.state.controller.now;
  for (const c of view.state.policy.classes) {
    let h = view.history.get(c.traffic_class);
    if (!h) { h = []; view.history.set(c.traffic_class, h); }
    if (h.length && h[h.length - 1].at === at) continue;
    h.push({at, estimates: c.estimates});
    if (h.length > HISTORY) h.shift();
  }
}

function render() {
  const s = view.state;
  $("version").textContent = `policy v${s.policy.version}`;
  renderEngines(s);
  renderFleet(s.fleet);
  renderTable(s.policy);
  renderDetail();
  renderAudit(s.audit);
  renderClassFilter(s.policy.classes);
  renderTimelineBuckets(s.policy.batch_bucket_upper_bounds);
}

function renderEngines(s) {
  const body = $("engines").tBodies[0];
  body.replaceChildren();
  for (const e of s.policy.engine_status || []) {
    const behind = Number(e.versions_behind || 0);
    const tr = el("tr", {"data-engine": e.engine_id});
    tr.append(el("td", {}, e.engine_id), el("td", {}, e.model), el("td", {}, e.hardware || "?"),
              el("td", {}, String(e.running_requests)),
              el("td", {}, `${Number(e.report_age_seconds).toFixed(1)} s ago`),
              el("td", {}, behind > 0 ? `v${e.policy_version_applied} (${behind} behind)`
                                      : `v${e.policy_version_applied}`));
    body.append(tr);
  }
  if (!body.children.length) {
    const tr = el("tr");
    tr.append(el("td", {colspan: "6"}, "no engine connected"));
    body.append(tr);
  }
}

function renderFleet(fleet) {
  $("fleet-section").hidden = !fleet;
  if (!fleet) return;
  const box = $("fleet");
  box.replaceChildren();
  const up = fleet.store_up === null ? "not reached yet" : fleet.store_up ? "reachable" : "UNREACHABLE";
  box.append(el("p", {}, `model ${fleet.model || "?"} · this sidecar ${fleet.sidecar} · state store ${up}`
    + ` · ${fleet.peers.length} other sidecar(s): `
    + fleet.peers.map((p) => `${p.sidecar} (${p.age_seconds.toFixed(0)} s)`).join(", ")));
  const recs = fleet.recommendations.classes || [];
  if (recs.length) {
    const list = el("ul");
    for (const r of recs) {
      const best = r.options[0];
      list.append(el("li", {}, `${r.traffic_class}: ${r.pool} pool, draft ${r.draft || "none"}`
        + (best ? ` (${best.goodput_tokens_per_second.toFixed(0)} tokens/s at batch ${r.batch_size})` : "")));
    }
    box.append(el("p", {}, "recommendations:"), list);
  }
}

// A decision's expected speedup over no speculation, as the CLI prints it: none where the
// posteriors cannot tell it from 1, and none where it slows the rest of a shared batch.
function speedupText(d) {
  if (d.too_little_evidence) return "too little evidence";
  const x = Number(d.expected_speedup);
  return x < 0.005 ? "slows the batch" : `${x.toFixed(2)}x`;
}

function renderTable(policy) {
  const bounds = policy.batch_bucket_upper_bounds;
  const head = $("ktable").tHead;
  const row = el("tr");
  row.append(el("th", {}, "class"));
  for (let b = 0; b <= bounds.length; b++) row.append(el("th", {}, `batch ${bucketLabel(b, bounds)}`));
  row.append(el("th", {title: "the class's share of the running sequences"}, "share"),
    el("th", {title: "expected: the controller's estimate for the class's choices (the best of its "
      + "batch ranges); measured: what its served speculative steps achieved (accepted tokens per "
      + "step over the step's cost relative to a step without drafts)"},
    "speedup over no speculation: expected / measured"));
  head.replaceChildren(row);
  const body = $("ktable").tBodies[0];
  // Batch ranges with a timed step: elsewhere the decisions come from the priors alone.
  const timedBuckets = new Set((policy.measured_batch_buckets || []).map(Number));
  const rows = [];
  for (const c of policy.classes) {
    const tr = el("tr", {"data-class": c.traffic_class});
    const name = el("th", {class: "cls", title: c.traffic_class === "default"
      ? "what an engine applies to a class the controller has not seen yet" : ""},
    c.traffic_class + (c.offline ? " (offline)" : ""));
    name.addEventListener("click", () => openClass(c.traffic_class));
    tr.append(name);
    const inForce = c.overrides.length > 0;
    for (const d of c.decisions) {
      const k = Number(d.k);
      const seen = timedBuckets.has(Number(d.batch_bucket || 0));
      const cell = el("td", {class: "kcell" + (k ? "" : " off") + (reasonName(d.reason) === "override" ? " ovr" : "")
        + (reasonName(d.reason) === "explore" ? " explore" : "") + (seen ? "" : " unmeasured"),
        "data-class": c.traffic_class, "data-bucket": String(d.batch_bucket), "data-k": String(k),
        title: `${k ? `draft ${d.draft}, K=${k}` : "speculation off"}; ${reasonName(d.reason)}; expected `
          + speedupText(d) + (d.probe_rate > 0 ? `; probing ${(100 * d.probe_rate).toFixed(1)}% of ${d.probe_steps ? "steps" : "requests"} at K=${d.probe_k}` : "")
          + (seen ? "" : "; no step measured at this batch size yet: from the priors")},
        k ? `${d.draft}:${k}` : "off");
      if (reasonName(d.reason) === "override") cell.append(el("span", {class: "ovr-mark"}, " ●"));
      tr.append(cell);
    }
    const share = c.batch_share === undefined ? "—" : `${(100 * c.batch_share).toFixed(0)}%`;
    // The best of the expectations the posteriors can tell from no speculation.
    const ranked = c.decisions.filter((d) => !d.too_little_evidence);
    const expected = !c.decisions.length ? "1.00x"
      : ranked.length ? `${Math.max(...ranked.map((d) => Number(d.expected_speedup))).toFixed(2)}x`
      : "too little evidence";
    const measured = c.measured_speedup === undefined ? "—" : `${c.measured_speedup.toFixed(2)}x`;
    tr.append(el("td", {}, share), el("td", {}, `${expected} expected / ${measured} measured`
      + (inForce ? " · override" : "")));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

// --- one class --------------------------------------------------------------------------------
// The controller keeps an hour of each class's estimates (/api/history); the page adds its own
// samples after that.
async function openClass(cls) {
  view.selected = cls;
  try {
    const data = await getJSON(`/api/history?class=${encodeURIComponent(cls)}`);
    const byTime = new Map();
    for (const s of data.samples) {
      if (!byTime.has(s.at)) byTime.set(s.at, {at: s.at, estimates: []});
      byTime.get(s.at).estimates.push({draft: s.draft, positions: s.positions.map(
        ([mean, lower, upper]) => ({mean, lower, upper, effective_tries: 1}))});
    }
    const live = (view.history.get(cls) || []).filter((h) => !byTime.has(h.at));
    const merged = [...byTime.values(), ...live].sort((a, b) => a.at - b.at).slice(-HISTORY);
    view.history.set(cls, merged);
  } catch (e) {
    // the page's own samples still draw
  }
  renderDetail();
}

function renderDetail() {
  const s = view.state;
  const c = s && s.policy.classes.find((x) => x.traffic_class === view.selected);
  $("detail").hidden = !c;
  if (!c) return;
  $("detail-title").textContent = `Class ${c.traffic_class}`;
  const facts = $("detail-facts");
  facts.replaceChildren();
  const running = (s.policy.engine_status || []).reduce((n, e) => n + Number(e.running_requests), 0);
  const share = c.batch_share === undefined ? null : c.batch_share;
  facts.append(
    el("span", {}, `load: ${share === null ? "—" : `${(share * running).toFixed(1)} of ${running} running sequences`}`),
    el("span", {}, `tokens per step measured: ${c.measured_tokens_per_step === undefined ? "—" : c.measured_tokens_per_step.toFixed(2)}`),
    el("span", {}, `measured speedup: ${c.measured_speedup === undefined ? "—" : c.measured_speedup.toFixed(2) + "x"}`));
  const ovr = $("overrides");
  ovr.replaceChildren();
  if (c.overrides.length) {
    ovr.append(el("p", {}, "Overrides (the first is in force):"));
    const list = el("ul");
    c.overrides.forEach((o) => list.append(el("li", {class: "override"}, overrideText(o))));
    ovr.append(list);
  } else {
    ovr.append(el("p", {}, "No override: the controller decides."));
  }
  $("band-level").textContent = `${Math.round(100 * s.controller.credible_level)}%`;
  // One draft at a time (the one in force by default): several drafts' bands would overlap.
  const drafts = c.estimates.filter((e) => e.positions.length && e.positions[0].effective_tries > 0)
    .map((e) => e.draft);
  const select = $("acceptance-draft");
  const inForce = (c.decisions.find((d) => Number(d.k) > 0) || {}).draft;
  const chosen = drafts.includes(select.value) && select.dataset.cls === c.traffic_class
    ? select.value : (drafts.includes(inForce) ? inForce : drafts[0] || "");
  select.replaceChildren(...drafts.map((d) => el("option", {value: d}, d)));
  select.value = chosen;
  select.dataset.cls = c.traffic_class;
  drawAcceptance(c.traffic_class, chosen);
}

function drawAcceptance(cls, draft) {
  const chart = $("acceptance-chart");
  chart.replaceChildren();
  const legend = $("acceptance-legend");
  legend.replaceChildren();
  const h = view.history.get(cls) || [];
  if (!h.length) return;
  const W = 600, H = 220, L = 36, B = 20;
  const t0 = h[0].at, t1 = Math.max(h[h.length - 1].at, t0 + 1);
  const x = (t) => L + (W - L - 8) * (t - t0) / (t1 - t0);
  const y = (v) => 8 + (H - B - 8) * (1 - v);
  for (const v of [0, 0.5, 1]) {
    chart.append(svg("line", {x1: L, x2: W - 8, y1: y(v), y2: y(v), stroke: "#ddd"}));
    const t = svg("text", {x: 4, y: y(v) + 4, "font-size": 11}); t.textContent = v.toFixed(1); chart.append(t);
  }
  // Drafts with evidence only: a bare prior's band would cover the chart.
  const last = h[h.length - 1].estimates.filter(
    (e) => e.draft === draft && e.positions.length && e.positions[0].effective_tries > 0);
  if (!last.length) legend.append(el("span", {}, "no acceptance evidence yet"));
  let series = 0;
  for (const est of last) {
    est.positions.forEach((p, i) => {
      if (i > 3) return;  // the first four positions keep the chart readable
      const color = COLORS[series++ % COLORS.length];
      const pts = h.map((s) => {
        const e = s.estimates.find((q) => q.draft === est.draft);
        return e && e.positions[i] ? [s.at, e.positions[i]] : null;
      }).filter(Boolean);
      if (!pts.length) return;
      const band = pts.map(([t, q]) => `${x(t)},${y(q.upper)}`).concat(
        pts.slice().reverse().map(([t, q]) => `${x(t)},${y(q.lower)}`)).join(" ");
      chart.append(svg("polygon", {points: band, fill: color, "fill-opacity": 0.15, stroke: "none"}));
      chart.append(svg("polyline", {points: pts.map(([t, q]) => `${x(t)},${y(q.mean)}`).join(" "),
        fill: "none", stroke: color, "stroke-width": 1.5}));
      const item = el("span"); const sw = el("i"); sw.style.background = color;
      item.append(sw, document.createTextNode(`${est.draft} position ${i + 1}: ${p.mean.toFixed(2)} [${p.lower.toFixed(2)}, ${p.upper.toFixed(2)}]`));
      legend.append(item);
    });
  }
}

// --- writes ----------------------------------------------------------------------------------
async function write(path, body) {
  const token = $("token").value.trim();
  sessionStorage.setItem("specpilot-token", token);
  const headers = {"Content-Type": "application/json"};
  if (token) headers.Authorization = `Bearer ${token}`;
  const status = $("write-status");
  try {
    const r = await fetch(path, {method: "POST", headers, body: JSON.stringify(body)});
    const answer = await r.json();
    if (!r.ok) {
      status.className = "write-status refused";
      status.textContent = `Refused (HTTP ${r.status}, ${answer.kind}): ${answer.error}`;
      return;
    }
    status.className = "write-status ok";
    status.textContent = `Done: policy version ${answer.policy_version}` + (answer.cleared === false ? " (nothing to clear)" : "");
    scheduleRefresh();
  } catch (e) {
    status.className = "write-status refused";
    status.textContent = `Not sent: ${e}`;
  }
}

function override(action) {
  const o = {traffic_class: view.selected, note: $("note").value, ...action};
  const scope = $("scope").value;
  if (scope) o.scope = scope;
  return write("/api/overrides", {override: o});
}

// --- decision log and timeline ----------------------------------------------------------------
function logItem(e) {
  const li = el("li", {"data-class": e.decision.traffic_class});
  li.append(el("time", {}, clock(e.unix_seconds)), document.createTextNode(e.text || ""));
  return li;
}

// The list holds the newest ``view.shown`` entries; "older" pages on from there (entries that
// arrive live are prepended and counted, so a page never repeats one).
async function loadLog(reset) {
  const cls = $("log-class").value;
  const offset = reset ? 0 : view.shown;
  const data = await getJSON(`/api/decisions?text=1&limit=${LOG_PAGE}&offset=${offset}`
                             + `&class=${encodeURIComponent(cls)}`);
  const items = data.events.slice().reverse().map(logItem);  // newest first
  if (reset) $("log").replaceChildren(...items); else $("log").append(...items);
  view.shown = offset + data.events.length;
  showLogCount(data.total);
}

function showLogCount(total) {
  $("log-count").textContent = `newest ${view.shown} of ${total} shown`;
  $("log-older").disabled = view.shown >= total;
}

function onDecision(e) {
  const cls = $("log-class").value;
  if (!cls || cls === e.decision.traffic_class) {
    $("log").prepend(logItem(e));
    view.shown += 1;
  }
  view.timeline.push(e);
  if (view.timeline.length > TIMELINE_EVENTS) view.timeline.shift();
  drawTimeline();
  scheduleRefresh();
}

async function loadTimeline() {
  const data = await getJSON(`/api/decisions?limit=${TIMELINE_EVENTS}`);
  view.timeline = data.events;
  drawTimeline();
}

function renderTimelineBuckets(bounds) {
  const select = $("timeline-bucket");
  if (select.options.length === bounds.length + 1) return;
  const chosen = select.value;
  select.replaceChildren();
  for (let b = 0; b <= bounds.length; b++) select.append(el("option", {value: String(b)}, bucketLabel(b, bounds)));
  select.value = chosen || "0";
}

function drawTimeline() {
  const chart = $("timeline");
  chart.replaceChildren();
  const legend = $("timeline-legend");
  legend.replaceChildren();
  const bucket = Number($("timeline-bucket").value || 0);
  const events = view.timeline.filter((e) => Number(e.decision.batch_bucket) === bucket);
  if (!events.length || !view.state) return;
  const W = 900, H = 240, L = 30, B = 22;
  const now = view.state.controller.now;
  const t0 = Math.min(...events.map((e) => e.unix_seconds)), t1 = Math.max(now, t0 + 1);
  const kMax = Math.max(4, ...events.map((e) => Number(e.decision.k)));
  const x = (t) => L + (W - L - 8) * (t - t0) / (t1 - t0);
  const y = (k) => 8 + (H - B - 8) * (1 - k / kMax);
  for (let k = 0; k <= kMax; k++) {
    chart.append(svg("line", {x1: L, x2: W - 8, y1: y(k), y2: y(k), stroke: "#eee"}));
    const t = svg("text", {x: 6, y: y(k) + 4, "font-size": 11}); t.textContent = String(k); chart.append(t);
  }
  const label = svg("text", {x: L, y: H - 4, "font-size": 11});
  label.textContent = `${clock(t0)} … ${clock(t1)}`;
  chart.append(label);
  const byClass = new Map();
  for (const e of events) {
    const c = e.decision.traffic_class;
    if (!byClass.has(c)) byClass.set(c, []);
    byClass.get(c).push(e);
  }
  let i = 0;
  for (const [cls, list] of byClass) {
    const color = COLORS[i++ % COLORS.length];
    const offset = (i % 5) * 1.2;  // classes with the same K stay visible side by side
    let d = "", prevK = null;
    for (const e of list) {
      const k = Number(e.decision.k);
      d += prevK === null ? `M${x(e.unix_seconds)},${y(k) + offset}` : `H${x(e.unix_seconds)}V${y(k) + offset}`;
      prevK = k;
    }
    d += `H${x(t1)}`;
    chart.append(svg("path", {d, fill: "none", stroke: color, "stroke-width": 1.6, "data-class": cls}));
    const item = el("span"); const sw = el("i"); sw.style.background = color;
    item.append(sw, document.createTextNode(cls));
    legend.append(item);
  }
}

function renderClassFilter(classes) {
  const select = $("log-class");
  const names = classes.map((c) => c.traffic_class);
  const have = Array.from(select.options).slice(1).map((o) => o.value);
  if (have.join("\n") === names.join("\n")) return;
  const chosen = select.value;
  select.replaceChildren(el("option", {value: ""}, "all"), ...names.map((n) => el("option", {value: n}, n)));
  select.value = names.includes(chosen) ? chosen : "";
}

// --- audit ------------------------------------------------------------------------------------
function auditItem(a) {
  const li = el("li", {class: a.outcome === "ok" ? "" : "refused"});
  const what = a.action === "set_override" ? `${a.what} on ${a.traffic_class}` : `clear on ${a.traffic_class}`;
  li.append(el("time", {}, clock(a.at)), document.createTextNode(
    `${what}${a.scope ? ` (${a.scope})` : ""} by ${a.actor}: ${a.outcome}${a.reason ? ` — ${a.reason}` : ""}`
    + (a.note ? ` · "${a.note}"` : "")));
  return li;
}
function renderAudit(entries) {
  $("audit").replaceChildren(...entries.slice().reverse().map(auditItem));
}
function addAudit(entry) {
  $("audit").prepend(auditItem(entry));
}

// --- wiring -----------------------------------------------------------------------------------
$("token").value = sessionStorage.getItem("specpilot-token") || "";
$("do-pin").addEventListener("click", () => override({pin_k: Number($("pin-k").value)}));
$("do-off").addEventListener("click", () => override({force_off: true}));
$("do-clear").addEventListener("click", () => {
  const body = {traffic_class: view.selected};
  if ($("scope").value) body.scope = $("scope").value;
  return write("/api/overrides/clear", body);
});
$("log-class").addEventListener("change", () => loadLog(true));
$("log-older").addEventListener("click", () => loadLog(false));
$("timeline-bucket").addEventListener("change", drawTimeline);
$("acceptance-draft").addEventListener("change", () => drawAcceptance(view.selected, $("acceptance-draft").value));
connect();
