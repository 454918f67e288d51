"""The health page (peer/dashboard.py serves it): one HTML file with its style and script
inline, no external resource, so it works offline. The script fetches `/api/swarm` every
{{REFRESH_MS}} ms and draws the tables, and the charts as SVG it builds itself. Every value from
the swarm is set as text (`textContent`), never as HTML: a peer id or ban reason is data."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>diloco-peer swarm</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 1em 2em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: .2em; } h2 { font-size: 1.1em; margin: 1.2em 0 .4em; }
table { border-collapse: collapse; } td, th { padding: 2px 6px; border-bottom: 1px solid #ddd; white-space: nowrap; }
th { text-align: left; background: #f4f4f4; } td.num { text-align: right; }
.mono { font-family: ui-monospace, monospace; } .bad { color: #b00; font-weight: bold; }
.ok { color: #070; } #status { color: #666; } .charts { display: flex; gap: 2em; flex-wrap: wrap; }
svg { background: #fafafa; border: 1px solid #ddd; } pre { background: #f7f7f7; padding: .5em; }
</style>
</head>
<body>
<h1>run <span id="run">?</span></h1>
<div>head version <b id="head-version">-</b>, <b id="live-count">0</b> live peers,
state hash at the head: <span id="head-hashes" class="mono">-</span>
<span id="served-by"></span></div>
<div id="status">connecting...</div>
<h2>Live peers</h2>
<table id="peers"><thead><tr><th>peer</th><th>version</th><th>state hash</th><th>steps/s</th>
<th>samples/s</th><th>client</th><th>last seen</th><th>memory</th><th>cpu</th><th>gpu</th><th>busy</th>
<th>in flight</th><th>rounds</th><th>steps</th><th>samples</th><th>banned by</th></tr></thead>
<tbody></tbody></table>
<h2>Forks and bans</h2>
<div id="forks">none</div><div id="bans">none</div>
<h2>Progress</h2>
<div class="charts">
<div>loss by version<br><svg id="chart-loss" width="460" height="220"></svg></div>
<div>version over time<br><svg id="chart-version" width="460" height="220"></svg></div>
</div>
<h2>Rounds</h2>
<table id="rounds"><thead><tr><th>version</th><th>loss</th><th>held-out ppl</th><th>peers</th>
<th>bytes</th></tr></thead><tbody></tbody></table>
<h2>Manifest</h2>
<pre id="manifest">-</pre>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
function cell(row, text, cls) {
  const td = document.createElement("td"); td.textContent = text;
  if (cls) td.className = cls; row.appendChild(td); return td;
}
function fmt(x, digits) { return x === null || x === undefined ? "-" : Number(x).toFixed(digits); }
function svgEl(name, attrs, text) {
  const el = document.createElementNS(NS, name);
  for (const k in attrs) el.setAttribute(k, attrs[k]);
  if (text !== undefined) el.textContent = text;
  return el;
}
// A line chart of points [{x, y}] into an SVG: axes with min/max labels, a circle per point.
function chart(svg, pts, xlabel, ylabel) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), L = 50, B = 30, P = 10;
  svg.appendChild(svgEl("line", {x1: L, y1: H - B, x2: W - P, y2: H - B, stroke: "#888"}));
  svg.appendChild(svgEl("line", {x1: L, y1: P, x2: L, y2: H - B, stroke: "#888"}));
  svg.appendChild(svgEl("text", {x: (W + L) / 2, y: H - 5, "text-anchor": "middle",
                                 "font-size": 11}, xlabel));
  if (!pts.length) return;
  const xs = pts.map(p => p.x), ys = pts.map(p => p.y);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - P);
  const sy = y => H - B - (y - y0) / (y1 - y0) * (H - B - P);
  svg.appendChild(svgEl("text", {x: L - 4, y: P + 8, "text-anchor": "end", "font-size": 10},
                        y1.toPrecision(4)));
  svg.appendChild(svgEl("text", {x: L - 4, y: H - B, "text-anchor": "end", "font-size": 10},
                        y0.toPrecision(4)));
  svg.appendChild(svgEl("text", {x: L, y: H - B + 12, "font-size": 10}, +x0.toPrecision(4)));
  svg.appendChild(svgEl("text", {x: W - P, y: H - B + 12, "text-anchor": "end", "font-size": 10},
                        +x1.toPrecision(4)));
  svg.appendChild(svgEl("text", {x: 12, y: (H - B) / 2, "font-size": 11,
                                 transform: `rotate(-90 12 ${(H - B) / 2})`}, ylabel));
  svg.appendChild(svgEl("polyline", {fill: "none", stroke: "#36c", "stroke-width": 1.5,
                                     points: pts.map(p => `${sx(p.x)},${sy(p.y)}`).join(" ")}));
  for (const p of pts)
    svg.appendChild(svgEl("circle", {cx: sx(p.x), cy: sy(p.y), r: 3, fill: "#36c",
                                     class: "point"}));
}
function render(doc) {
  document.getElementById("run").textContent = doc.run;
  document.getElementById("head-version").textContent = doc.head_version ?? "-";
  document.getElementById("live-count").textContent = doc.live_count;
  const hashes = document.getElementById("head-hashes");
  hashes.textContent = doc.head_hashes.map(h => h.slice(0, 12)).join(", ") || "-";
  hashes.className = "mono " + (doc.head_hashes.length > 1 ? "bad" : "ok");
  document.getElementById("served-by").textContent =
    doc.served_by ? `(served by peer ${doc.served_by.slice(-10)})` : "";
  const body = document.querySelector("#peers tbody"); body.replaceChildren();
  for (const p of doc.peers) {
    const row = document.createElement("tr"); row.dataset.peer = p.peer_id;
    cell(row, p.peer_id.slice(-10), "mono"); cell(row, p.version, "num version");
    cell(row, p.state_hash.slice(0, 12), "mono hash"); cell(row, fmt(p.speed, 2), "num");
    cell(row, fmt(p.samples_per_s, 1), "num"); cell(row, p.client ? "client" : "full");
    cell(row, `${fmt(p.last_seen_s, 0)}s ago`, "num");
    cell(row, p.rss_mb === null ? "-" : `${fmt(p.rss_mb, 0)} MB`, "num");
    cell(row, p.cpu_percent === null ? "-" : `${fmt(p.cpu_percent, 0)}%`, "num");
    cell(row, p.gpu_mem_mb === null ? "-" : `${fmt(p.gpu_mem_mb, 0)} MB`, "num");
    cell(row, p.utilization == null ? "-" : `${fmt(100 * p.utilization, 0)}%`, "num");
    cell(row, p.in_flight_samples || "-", "num");
    const c = p.contribution || {};
    cell(row, c.rounds ?? "-", "num"); cell(row, c.steps || "-", "num");
    cell(row, c.samples || "-", "num");
    cell(row, p.banned_by || "-", p.banned_by ? "num bad" : "num");
    body.appendChild(row);
  }
  const forks = Object.entries(doc.forks);
  document.getElementById("forks").textContent = forks.length ?
    "forks: " + forks.map(([v, hs]) => `v${v}: ${hs.map(h => h.slice(0, 12)).join(" / ")}`)
      .join("; ") : "no forks";
  const bans = Object.entries(doc.banned);
  document.getElementById("bans").textContent = bans.length ?
    "bans: " + bans.map(([p, b]) => `${p.slice(-10)} by ${b.by.length} (${b.reasons.join("; ")})`)
      .join("; ") : "no bans";
  const loss = doc.chart.filter(p => p.loss !== null).map(p => ({x: p.version, y: p.loss}));
  chart(document.getElementById("chart-loss"), loss, "version", "loss");
  const t0 = doc.chart.length ? Math.min(...doc.chart.map(p => p.time)) : 0;
  const vt = doc.chart.map(p => ({x: (p.time - t0) / 60, y: p.version})).sort((a, b) => a.x - b.x);
  chart(document.getElementById("chart-version"), vt, "minutes", "version");
  const rounds = document.querySelector("#rounds tbody"); rounds.replaceChildren();
  for (const p of doc.chart.slice(-20).reverse()) {
    const row = document.createElement("tr");
    cell(row, p.version, "num"); cell(row, fmt(p.loss, 3), "num"); cell(row, fmt(p.ppl, 2), "num");
    cell(row, p.peers, "num");
    cell(row, p.bytes === null ? "-" : `${(p.bytes / 1e6).toFixed(2)} MB`, "num");
    rounds.appendChild(row);
  }
  document.getElementById("manifest").textContent =
    doc.manifest ? JSON.stringify(doc.manifest, null, 1) : "-";
  document.getElementById("status").textContent =
    "updated " + new Date(doc.time * 1000).toLocaleTimeString();
}
async function refresh() {
  try {
    const r = await fetch("/api/swarm", {cache: "no-store"});
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
  } catch (e) {
    document.getElementById("status").textContent = "cannot read the swarm: " + e;
  }
}
refresh(); setInterval(refresh, {{REFRESH_MS}});
</script>
</body>
</html>
"""
