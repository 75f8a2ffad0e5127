"""The dashboard's page (:mod:`.dashboard`): one HTML document, its style and script inline,
nothing loaded from elsewhere. It polls ``/view.json`` every two seconds and redraws.

Elements a test or a script may read carry ``data-testid``: ``agents-online``,
``agents-total``, ``phase``, ``round``, ``accuracy``, ``release``, ``releases`` (a table
of release → head agents on it), ``rejected``, ``agents`` (the listed page of agents);
``document.body.dataset.updated`` is the shown view's ``updated`` and
``document.body.dataset.renderMs`` how long drawing it took.
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>edgepfl fleet</title>
<style>
  :root { --fg: #1d2330; --muted: #667085; --line: #e4e7ec; --ok: #1a7f37; --bad: #b42318; --accent: #2e5aac; }
  body { font: 14px/1.4 system-ui, sans-serif; color: var(--fg); margin: 0; background: #f8f9fb; }
  header { padding: 12px 20px; background: #fff; border-bottom: 1px solid var(--line); display: flex; gap: 16px;
           align-items: baseline; flex-wrap: wrap; }
  header h1 { font-size: 18px; margin: 0; }
  #problem { color: var(--bad); }
  main { padding: 16px 20px; display: grid; gap: 16px; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); }
  section { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 12px 14px; overflow-x: auto; }
  section.wide { grid-column: 1 / -1; }
  h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); margin: 0 0 8px; }
  .cards { display: flex; gap: 20px; flex-wrap: wrap; }
  .card b { display: block; font-size: 22px; }
  .card span { color: var(--muted); font-size: 12px; }
  table { border-collapse: collapse; width: 100%; }
  th, td { text-align: left; padding: 3px 8px 3px 0; border-bottom: 1px solid var(--line); white-space: nowrap; }
  th { color: var(--muted); font-weight: 500; }
  td.num, th.num { text-align: right; }
  /* a release id is long and its panel a quarter of a screen: it wraps rather than runs out of view */
  table.wraps th, table.wraps td:first-child { white-space: normal; overflow-wrap: anywhere; }
  .on { color: var(--ok); } .off { color: var(--muted); } .warn { color: var(--bad); }
  svg { width: 100%; height: 180px; }
  input { padding: 4px 6px; border: 1px solid var(--line); border-radius: 4px; }
  button { padding: 3px 8px; }
</style>
</head>
<body>
<header>
  <h1>edgepfl · <span id="federation">…</span></h1>
  <span id="method"></span>
  <span id="updated"></span>
  <span id="problem"></span>
</header>
<main>
  <section class="wide">
    <div class="cards">
      <div class="card"><b data-testid="agents-online">–</b><span>agents online</span></div>
      <div class="card"><b data-testid="agents-total">–</b><span>agents known</span></div>
      <div class="card"><b data-testid="phase">–</b><span>phase</span></div>
      <div class="card"><b data-testid="round">–</b><span>round</span></div>
      <div class="card"><b data-testid="accuracy">–</b><span id="accuracy-label">latest accuracy</span></div>
      <div class="card"><b data-testid="release">–</b><span>current release</span></div>
    </div>
  </section>
  <section><h2>Accuracy by round</h2><svg id="curve" viewBox="0 0 400 180" preserveAspectRatio="none"></svg></section>
  <section><h2>Releases on head agents</h2><table data-testid="releases" class="wraps"></table>
    <p data-testid="rollout" class="muted"></p></section>
  <section><h2>Rejected and refused, by reason</h2><table data-testid="rejected"></table></section>
  <section class="wide">
    <h2>Agents</h2>
    <p><input id="filter" placeholder="filter by id, tier or release" size="32">
       <button id="prev">‹</button> <span id="page"></span> <button id="next">›</button></p>
    <table data-testid="agents"></table>
  </section>
</main>
<script>
"use strict";
const PAGE_SIZE = 200;
const STALE_HEARTBEATS = __STALE_HEARTBEATS__;  // status.py's, filled in by the server
let latest = null, page = 0;
const $ = (id) => document.getElementById(id);
const byTest = (name) => document.querySelector(`[data-testid="${name}"]`);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const pct = (a) => a == null ? "–" : (100 * a).toFixed(2) + " %";
const ago = (t) => { const s = Math.max(0, Date.now() / 1000 - t); return s < 120 ? s.toFixed(0) + " s ago" : s < 7200 ? (s / 60).toFixed(0) + " min ago" : (s / 3600).toFixed(1) + " h ago"; };

function rows(table, head, body) {
  table.innerHTML = "<tr>" + head.map((h) => `<th${h.num ? ' class="num"' : ""}>${esc(h.t)}</th>`).join("") + "</tr>" +
    body.map((r) => "<tr>" + r.map((c, i) => `<td${head[i].num ? ' class="num"' : ""}>${c}</td>`).join("") + "</tr>").join("");
}

// what the rollout's last judged stage measured (status.py's _measured says the same)
function measured(r) {
  if (!r || r.paired == null) return "";
  const pts = (x) => (x >= 0 ? "+" : "") + (100 * x).toFixed(1);
  let said = r.mean_change == null ? "no accuracy compared (no device had a report on the release before it)" :
    `held-out accuracy ${pts(r.mean_change)} points on average over ${r.paired} devices, worst ${pts(r.worst_change || 0)}`;
  if (r.latency_ratio != null) said += `; encoder time ${r.latency_ratio.toFixed(2)}x the release before`;
  return `<br>stage ${r.stage} measured: ${said}`;
}

function curve(history) {
  const svg = $("curve");
  if (!history.length) { svg.innerHTML = '<text x="10" y="90" fill="#667085">no evaluated round yet</text>'; return; }
  const last = history[history.length - 1][0], first = history[0][0], span = Math.max(1, last - first);
  const x = (r) => 30 + 360 * (r - first) / span, y = (a) => 170 - 160 * a;
  const points = history.map(([r, a]) => `${x(r).toFixed(1)},${y(a).toFixed(1)}`).join(" ");
  const grid = [0, 0.5, 1].map((a) => `<line x1="30" x2="390" y1="${y(a)}" y2="${y(a)}" stroke="#e4e7ec"/><text x="0" y="${y(a) + 4}" font-size="10" fill="#667085">${a * 100}%</text>`).join("");
  const final = history.filter((h) => h[2]).map(([r, a]) => `<circle cx="${x(r)}" cy="${y(a)}" r="3" fill="#1a7f37"><title>final evaluation ${pct(a)}</title></circle>`).join("");
  svg.innerHTML = grid + `<polyline fill="none" stroke="#2e5aac" stroke-width="2" points="${points}"/>` + final;
}

function draw() {
  if (!latest) return;
  const t0 = performance.now();
  const v = latest.view;
  $("federation").textContent = v.federation;
  $("method").textContent = v.method;
  // a finished run's view, or one not republished for STALE_HEARTBEATS of its heartbeats (the
  // coordinator killed, its host down), says what the agents were, not what they are
  const silent = v.heartbeat_s && Date.now() / 1000 - v.updated > STALE_HEARTBEATS * v.heartbeat_s;
  const past = v.phase === "done" || silent;
  $("updated").textContent = "view of " + new Date(v.updated * 1000).toLocaleTimeString() +
    (silent ? " — stale: the coordinator may have stopped" : "") +
    (past ? "; agent states are as of then, not now" : "");
  const online = Object.values(v.online || {}).reduce((a, b) => a + b, 0);
  byTest("agents-online").textContent = (past ? "was " : "") + online +
    Object.entries(v.online || {}).map(([t, n]) => ` · ${n} ${t}`).join("");
  byTest("agents-total").textContent = v.agents.length + v.agents_left_out;
  byTest("phase").textContent = v.phase;
  byTest("round").textContent = v.round < 0 ? "–" : `${v.round} of 0..${v.rounds - 1}`;
  byTest("accuracy").textContent = pct(v.last_accuracy);
  $("accuracy-label").textContent = v.last_accuracy == null ? "latest accuracy" :
    (v.last_accuracy_final ? "final evaluation" : `accuracy, round ${v.last_accuracy_round}`);
  byTest("release").textContent = v.release || "none";
  curve(latest.history);

  // the view's counts cover every head agent online; a view that lists all agents adds the offline ones
  const releases = new Map(Object.entries(v.releases || {}).map(([id, n]) => [id, {online: n, listed: 0, refused: 0}]));
  for (const a of v.agents) if (a.tier === "head") {
    const key = a.release || "none";
    const r = releases.get(key) || {online: 0, listed: 0, refused: 0};
    if (!v.releases) r.online += a.online ? 1 : 0;
    r.listed += 1; if (a.release_refused) r.refused += 1;
    releases.set(key, r);
  }
  rows(byTest("releases"), [{t: "release"}, {t: "online", num: 1}, {t: "listed", num: 1}, {t: "refused next", num: 1}],
    [...releases.entries()].sort((a, b) => b[1].online - a[1].online).map(([id, r]) =>
      [esc(id) + (id === v.release ? " (current)" : ""), r.online, r.listed, r.refused]));
  const r = v.rollout;
  byTest("rollout").innerHTML = !r ? "no staged rollout" :
    `rollout of <b>${esc(r.release)}</b>: ${r.state === "promoted" ? "promoted to the whole fleet" :
      `stage ${r.stage} of ${r.stages.length} (${(100 * r.stages[Math.max(0, r.stage - 1)]).toFixed(0)} %), ` +
      `${r.reported} of ${r.admitted} reported` + (r.state === "staging" ? "" :
        // held: passed its stages so far, waiting for the operator; only a halt is drawn as one
        r.state === "held" ? ` — held (edgepfl release promote or halt)` :
        ` — <span class="warn">${r.to_release ? "halted and rolled back to " + esc(r.to_release) : "halted"}: ` +
        `${r.reasons.map(esc).join("; ")}</span>`)}` + measured(r);
  const reasons = [...Object.entries(v.rejected || {}).map(([k, n]) => ["rejected", k, n]),
                   ...Object.entries(v.refused || {}).map(([k, n]) => ["refused", k, n])].sort((a, b) => b[2] - a[2]);
  rows(byTest("rejected"), [{t: ""}, {t: "reason"}, {t: "count", num: 1}],
    reasons.length ? reasons.map(([w, k, n]) => [w, esc(k), n]) : [["none", "", ""]]);

  const needle = $("filter").value.trim().toLowerCase();
  const shown = needle ? v.agents.filter((a) => (a.id + " " + a.tier + " " + (a.release || "") + " " + (a.site || "")).toLowerCase().includes(needle)) : v.agents;
  const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
  page = Math.min(page, pages - 1);
  $("page").textContent = `${shown.length ? page * PAGE_SIZE + 1 : 0}–${Math.min(shown.length, (page + 1) * PAGE_SIZE)} of ${shown.length}` +
    (v.agents_left_out ? ` (${v.agents_left_out} more not in the view)` : "");
  rows(byTest("agents"), [{t: "agent"}, {t: "tier"}, {t: "state"}, {t: "last seen"}, {t: "release"}, {t: "samples", num: 1}, {t: "note"}],
    shown.slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE).map((a) => [
      esc(a.id), a.tier, a.online ? (past ? '<span class="off">was online</span>' : '<span class="on">online</span>') :
        '<span class="off">offline</span>', ago(a.last_seen),
      esc(a.release || ""), a.num_train,
      '<span class="warn">' + esc(a.excluded || a.suspended || a.release_refused || (a.benched_until != null ? "benched until round " + a.benched_until : "")) + "</span>" +
        esc(a.tier === "site" ? `${a.devices} devices, last sum round ${a.last_sum ?? "none"}` : a.site ? "via " + a.site : "")]));
  document.body.dataset.renderMs = (performance.now() - t0).toFixed(1);
  document.body.dataset.updated = String(v.updated);
}

async function poll() {
  try {
    const response = await fetch("view.json", {cache: "no-store"});
    const body = await response.json();
    if (!response.ok) { $("problem").textContent = body.error || response.statusText; }
    else {
      $("problem").textContent = "";
      const changed = !latest || body.view.updated !== latest.view.updated || body.received !== latest.received;
      latest = changed ? body : latest;
      draw();  // also unchanged: a view ages (stale after STALE_HEARTBEATS heartbeats) while nothing comes
    }
  } catch (e) { $("problem").textContent = "the dashboard server does not answer: " + e; }
  setTimeout(poll, latest ? 2000 : 500);  // until the first view, ask more often
}
$("filter").addEventListener("input", () => { page = 0; draw(); });
$("prev").addEventListener("click", () => { page = Math.max(0, page - 1); draw(); });
$("next").addEventListener("click", () => { page += 1; draw(); });
poll();
</script>
</body>
</html>
"""
