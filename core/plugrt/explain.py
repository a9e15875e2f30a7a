"""A placement picture: one self-contained HTML page of the graph coloured by provider."""

from __future__ import annotations

import html
import json
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .session import Session

__all__ = ["explain_data", "explain_html", "write_explain", "try_capture_as_run_does", "PALETTE"]

#: Provider colours, in the order providers are consulted (the fallback is last).
PALETTE = ("#e8871e", "#3f9b52", "#b5479b", "#2aa1b3", "#c9a227", "#8c6bb1", "#d45a5a")
_FALLBACK_COLOUR = "#4e79a7"

#: Above this many nodes the page starts with every partition collapsed to one box.
COLLAPSE_ABOVE = 80


def _colours(providers: list[str]) -> dict[str, str]:
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(providers[:-1])}
    if providers:
        colours[providers[-1]] = _FALLBACK_COLOUR
    return colours


def _capture_parts(capture: Any) -> tuple[int, list[tuple[str, str]]] | None:
    """(captured segments, seams) from what ``try_capture`` returned, or its report."""
    if capture is None:
        return None
    if hasattr(capture, "seams"):  # a CaptureReport
        return len(capture.segments), list(capture.seams)
    if getattr(capture, "captured", False):  # Captured
        return len(capture.report.segments), list(capture.report.seams)
    return 0, list(capture.report)  # NotCapturable: every node declined, with why


def explain_data(session: "Session", capture: Any = None) -> dict[str, Any]:
    """What the page draws, from the session's public ``model`` and ``placement``, and
    optionally what ``session.try_capture`` returned (for the seams)."""
    from .provider import node_label

    report = session.placement
    captured = _capture_parts(capture)
    partition_of: dict[str, tuple[str, str]] = {}
    for part in report.partitions:
        for name in part.node_names:
            partition_of[name] = (part.name, part.provider)
    graph = session.model.graph
    nodes = []
    for node in graph:
        name = node_label(node)  # the name the placement report uses
        partition, provider = partition_of.get(name, ("?", "?"))
        nodes.append(
            {
                "name": name,
                "op": node.op_type if not node.domain else f"{node.domain}::{node.op_type}",
                "partition": partition,
                "provider": provider,
                "inputs": [v.name for v in node.inputs if v is not None and v.name],
                "outputs": [v.name for v in node.outputs if v is not None and v.name],
            }
        )
    fallbacks: dict[str, list[list[str]]] = {}
    for fb in report.fallbacks:
        fallbacks.setdefault(fb.node, []).append([fb.declined_by, fb.reason, fb.placed_on])
    # a seam names a node, or a whole partition whose provider cannot capture
    part_names = {p.name for p in report.partitions}
    seams = {name: reason for name, reason in (captured[1] if captured is not None else ())}
    providers = list(report.providers)
    return {
        "nodes": nodes,
        "partitions": [
            {
                "name": p.name,
                "provider": p.provider,
                "nodes": list(p.node_names),
                "restored": p.restored,
                "estimated_ms": None if p.estimated_s is None else p.estimated_s * 1e3,
                "measured_ms": None if p.measured_s is None else p.measured_s * 1e3,
            }
            for p in report.partitions
        ],
        "graph_inputs": [v.name for v in graph.inputs if v.name and not v.const_value],
        "graph_outputs": [v.name for v in graph.outputs if v.name],
        "providers": providers,
        "colours": _colours(providers),
        "nodes_per_provider": dict(report.nodes_per_provider),
        "fallbacks": fallbacks,
        "transfers": [
            [t.value, t.source, t.target, None if t.estimated_s is None else t.estimated_s * 1e3]
            for t in report.transfers
        ],
        "strategy": report.estimate.strategy,
        "estimated_ms": None if report.estimate.total_s is None else report.estimate.total_s * 1e3,
        "alternatives_ms": {label: s * 1e3 for label, s in report.estimate.alternatives},
        "measured_ms": {label: s * 1e3 for label, s in report.estimate.measured},
        "seams": {k: v for k, v in seams.items() if k not in part_names},
        "partition_seams": {k: v for k, v in seams.items() if k in part_names},
        "captured_segments": captured[0] if captured is not None else None,
        "collapsed": len(nodes) > COLLAPSE_ABOVE,
    }


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _times_html(data: dict[str, Any]) -> list[str]:
    """Estimated (and, after placement="measure", measured) time per partition and transfer."""
    esc = html.escape
    if data["estimated_ms"] is None and not data["measured_ms"]:
        return []
    weighed = "; ".join(f"{esc(label)}: {value:.3f} ms" for label, value in data["alternatives_ms"].items())
    measured = "; ".join(f"{esc(label)}: {value:.3f} ms" for label, value in data["measured_ms"].items())
    out = [
        f"<details open><summary>time per run: placed by {esc(data['strategy'])}, estimated "
        f"{_ms(data['estimated_ms'])} ms</summary>",
        f"<p>estimates weighed: {weighed or '-'}" + (f"; measured: {measured}" if measured else "") + "</p>",
        '<table class="times"><tr><th>partition or transfer</th><th>provider</th><th>estimated ms</th>'
        "<th>measured ms</th></tr>",
    ]
    for part in data["partitions"]:
        out.append(
            f"<tr><td>{esc(part['name'])}</td><td>{esc(part['provider'])}</td><td>{_ms(part['estimated_ms'])}</td>"
            f"<td>{_ms(part['measured_ms'])}</td></tr>"
        )
    for value, source, target, estimated in data["transfers"]:
        out.append(
            f"<tr><td>transfer {esc(value)}</td><td>{esc(source)} &rarr; {esc(target)}</td><td>{_ms(estimated)}</td>"
            "<td></td></tr>"
        )
    out.append("</table></details>")
    return out


def _summary_html(data: dict[str, Any], title: str) -> str:
    """The placement summary as static HTML (readable without the script)."""
    esc = html.escape
    rows = []
    for name in data["providers"]:
        colour = data["colours"].get(name, "#999")
        count = data["nodes_per_provider"].get(name, 0)
        parts = sum(1 for p in data["partitions"] if p["provider"] == name)
        rows.append(
            f'<tr><td><span class="swatch" style="background:{colour}"></span>{esc(name)}</td>'
            f"<td>{count}</td><td>{parts}</td></tr>"
        )
    out = [
        f"<h1>{esc(title)}</h1>",
        '<table class="summary"><tr><th>provider</th><th>nodes</th><th>partitions</th></tr>',
        *rows,
        "</table>",
        f"<p>{len(data['nodes'])} nodes in {len(data['partitions'])} partitions; "
        f"{sum(len(v) for v in data['fallbacks'].values())} fallbacks; {len(data['transfers'])} transfers"
        + (
            f"; capture: {data['captured_segments']} segment(s), "
            f"{len(data['seams']) + len(data['partition_seams'])} seam(s) run eagerly"
            if data["captured_segments"] is not None
            else "; capture not tried"
        )
        + ".</p>",
    ]
    if data["fallbacks"]:
        grouped: Counter[tuple[str, str, str, str]] = Counter()
        for node in data["nodes"]:
            for declined_by, reason, placed_on in data["fallbacks"].get(node["name"], ()):
                grouped[(node["op"], declined_by, reason, placed_on)] += 1
        out.append("<details open><summary>fallbacks by reason</summary><table class=\"fallbacks\">")
        out.append("<tr><th>op</th><th>declined by</th><th>reason</th><th>ran on</th><th>nodes</th></tr>")
        for (op, declined_by, reason, placed_on), count in grouped.most_common():
            out.append(
                f"<tr><td>{esc(op)}</td><td>{esc(declined_by)}</td><td>{esc(reason)}</td>"
                f"<td>{esc(placed_on)}</td><td>{count}</td></tr>"
            )
        out.append("</table></details>")
    out.extend(_times_html(data))
    if data["transfers"]:
        out.append("<details><summary>transfers</summary><ul>")
        out.extend(f"<li>{esc(v)}: {esc(s)} &rarr; {esc(t)}</li>" for v, s, t, *_ in data["transfers"])
        out.append("</ul></details>")
    return "\n".join(out)


_CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; }
table { border-collapse: collapse; margin: 4px 0 8px; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 6px; vertical-align: -1px; border-radius: 2px; }
.legend span { margin-right: 14px; }
.controls button { margin-right: 6px; }
#graph { border-top: 1px solid #ddd; margin-top: 8px; overflow: auto; }
svg text { font: 11px system-ui, sans-serif; pointer-events: none; }
svg .item { cursor: pointer; }
svg .item rect.box { stroke: #333; stroke-width: 0.6; }
svg .item.fallback rect.box { stroke: #c00; stroke-width: 2.4; stroke-dasharray: 5 2; }
svg .item.seam rect.box { stroke: #000; stroke-width: 2.4; stroke-dasharray: 1 2; }
svg .frame { fill: none; stroke-width: 1.4; stroke-dasharray: 6 3; }
svg .edge { fill: none; stroke: #8a8a8a; stroke-width: 1; }
svg .edge.transfer { stroke: #d00; stroke-width: 2.5; stroke-dasharray: 7 3; }
svg .io rect { fill: #f3f3f3; stroke: #999; }
"""

# The layout runs in the page so that expanding a partition re-lays the graph out:
# partitions stacked in execution order, each laid out in layers (longest path) inside
# its own frame; edges between partitions bend out to the right gutter.
_SCRIPT = r"""
(function () {
  const D = JSON.parse(document.getElementById('explain-data').textContent);
  const NS = 'http://www.w3.org/2000/svg';
  const byName = new Map(D.nodes.map((n, i) => [n.name, Object.assign({index: i}, n)]));
  const producer = new Map();
  D.nodes.forEach(n => n.outputs.forEach(v => producer.set(v, n.name)));
  const transfers = new Map(D.transfers.map(t => [t[0], t]));
  const expanded = new Set();
  // '#expand-all' or '#expand=name,name' in the address opens partitions on load
  const asked = location.hash.startsWith('#expand=') ? decodeURIComponent(location.hash.slice(8)).split(',') : [];
  if (!D.collapsed || location.hash === '#expand-all') D.partitions.forEach(p => expanded.add(p.name));
  asked.forEach(name => expanded.add(name));

  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function textWidth(s) { return 7 * s.length + 16; }
  function frameLabel(p) { return p.name + ' (' + p.provider + ')' + (p.nodes.length > 1 ? '  \u2212 click to collapse' : ''); }
  function nodeTitle(n) {
    let t = n.name + ' (' + n.op + ') on ' + n.provider + ', partition ' + n.partition;
    (D.fallbacks[n.name] || []).forEach(f => { t += '\nfallback: ' + f[0] + ' declined: ' + f[1] + '; ran on ' + f[2]; });
    const seam = D.seams[n.name] !== undefined ? D.seams[n.name] : D.partition_seams[n.partition];
    if (seam !== undefined) t += '\ncapture seam (runs eagerly): ' + seam;
    return t;
  }

  function items() {
    // one item per graph input, collapsed partition, node of an expanded partition, output
    const list = [], itemOf = new Map();
    D.graph_inputs.forEach(v => { const it = {kind: 'io', label: v, id: 'in:' + v, nodes: []}; list.push(it); itemOf.set('in:' + v, it); });
    D.partitions.forEach(p => {
      if (expanded.has(p.name)) {
        p.nodes.forEach(name => {
          const n = byName.get(name) || {name: name, op: '?', provider: p.provider, partition: p.name, inputs: [], outputs: []};
          const it = {kind: 'node', label: n.op, sub: name, id: name, nodes: [n], partition: p};
          list.push(it); itemOf.set(name, it);
        });
      } else {
        const nodes = p.nodes.map(name => byName.get(name)).filter(Boolean);
        const ops = [...new Set(nodes.map(n => n.op))];
        const it = {kind: 'part', label: p.name + ' \u00b7 ' + p.nodes.length + ' node' + (p.nodes.length === 1 ? '' : 's'),
                    sub: ops.slice(0, 4).join(', ') + (ops.length > 4 ? ', \u2026' : ''), id: 'part:' + p.name, nodes: nodes, partition: p};
        list.push(it); nodes.forEach(n => itemOf.set(n.name, it));
      }
    });
    D.graph_outputs.forEach(v => { const it = {kind: 'io', label: v, id: 'out:' + v, nodes: [], reads: [v]}; list.push(it); itemOf.set('out:' + v, it); });
    return {list, itemOf};
  }

  function edgesOf(list, itemOf) {
    const seen = new Map();
    function add(from, to, value) {
      if (!from || !to || from === to) return;
      const key = from.id + '\u0000' + to.id;
      const e = seen.get(key) || {from, to, values: [], transfer: false};
      e.values.push(value);
      if (transfers.has(value) && from.kind !== 'io') e.transfer = true;
      seen.set(key, e);
    }
    list.forEach(it => {
      const reads = it.reads || [].concat(...it.nodes.map(n => n.inputs));
      reads.forEach(v => add(producer.has(v) ? itemOf.get(producer.get(v)) : itemOf.get('in:' + v), it, v));
    });
    return [...seen.values()];
  }

  function draw() {
    const {list, itemOf} = items();
    const edges = edgesOf(list, itemOf);
    // groups stacked top to bottom: inputs, each partition, outputs
    const groups = [];
    let current = null;
    list.forEach(it => {
      const key = it.kind === 'io' ? it.id.slice(0, 3) : it.partition.name;
      if (!current || current.key !== key) { current = {key, items: [], partition: it.partition, expanded: it.kind === 'node'}; groups.push(current); }
      current.items.push(it);
    });
    const H = 34, VGAP = 22, HGAP = 14, PAD = 12;
    let y = 10, width = 0;
    groups.forEach(g => {
      // layers inside the group: longest path over edges between its own items
      const inGroup = new Set(g.items);
      g.items.forEach(it => { it.layer = 0; });
      edges.forEach(e => { if (inGroup.has(e.from) && inGroup.has(e.to)) e.to.layer = Math.max(e.to.layer, e.from.layer + 1); });
      const layers = [];
      g.items.forEach(it => { (layers[it.layer] = layers[it.layer] || []).push(it); });
      const framed = g.expanded;
      const top = y + (framed ? PAD + 14 : 0);
      let inner = 0;
      layers.forEach((row, r) => {
        let x = 0;
        row.forEach(it => { it.w = Math.max(90, textWidth(it.label) + 24, textWidth(it.sub || '') - 8); it.h = it.kind === 'part' ? H + 6 : H; it.x = x; x += it.w + HGAP; it.y = top + r * (H + VGAP); });
        row.width = x - HGAP; inner = Math.max(inner, row.width);
      });
      layers.forEach(row => { const shift = (inner - row.width) / 2; row.forEach(it => { it.x += shift; }); });
      g.label = framed ? frameLabel(g.partition) : '';
      g.width = framed ? Math.max(inner + 2 * PAD, textWidth(g.label) - 0.5 * g.label.length) : inner;
      if (framed && g.width > inner + 2 * PAD) { const extra = (g.width - inner - 2 * PAD) / 2; g.items.forEach(it => { it.x += extra; }); }
      g.top = y;
      g.height = layers.length * (H + VGAP) - VGAP + (framed ? 2 * PAD + 14 : 0) + (g.items[0].kind === 'part' ? 6 : 0);
      y += g.height + VGAP + 4;
      width = Math.max(width, g.width);
    });
    const GUTTER = 160, LEFT = 20;
    groups.forEach(g => {
      const offset = LEFT + (width - g.width) / 2 + (g.expanded ? PAD : 0);
      g.items.forEach(it => { it.x += offset; });
      g.left = LEFT + (width - g.width) / 2;
    });

    const host = document.getElementById('graph');
    host.innerHTML = '';
    const svg = el('svg', {width: width + LEFT + GUTTER, height: y + 10, id: 'placement-graph'}, host);
    const edgeLayer = el('g', {}, svg);
    groups.forEach(g => {
      if (!g.expanded) return;
      const p = g.partition, colour = D.colours[p.provider] || '#999';
      const frame = el('g', {class: 'partition-frame', 'data-partition': p.name}, svg);
      el('rect', {class: 'frame', x: g.left, y: g.top, width: g.width, height: g.height, rx: 6, stroke: colour}, frame);
      const label = el('text', {x: g.left + 6, y: g.top + 14, fill: colour}, frame);
      label.textContent = g.label;
      const hit = el('rect', {x: g.left, y: g.top, width: g.width, height: 18, fill: 'transparent', style: 'cursor:pointer'}, frame);
      el('title', {}, hit).textContent = 'collapse ' + p.name;
      hit.addEventListener('click', () => { expanded.delete(p.name); draw(); });
    });
    list.forEach(it => {
      const g = el('g', {class: 'item ' + it.kind, transform: 'translate(' + it.x + ',' + it.y + ')'}, svg);
      const title = el('title', {}, g);
      if (it.kind === 'io') {
        g.setAttribute('class', 'io');
        g.setAttribute('data-value', it.label);
        el('rect', {width: it.w, height: it.h, rx: 16}, g);
        el('text', {x: 8, y: 21}, g).textContent = it.label;
        title.textContent = (it.id.startsWith('in:') ? 'graph input ' : 'graph output ') + it.label;
        return;
      }
      const p = it.partition, colour = D.colours[p.provider] || '#999';
      const fallbacks = it.nodes.filter(n => D.fallbacks[n.name]);
      const seams = it.nodes.filter(n => D.seams[n.name] !== undefined || D.partition_seams[n.partition] !== undefined);
      if (fallbacks.length) g.classList.add('fallback');
      if (seams.length) g.classList.add('seam');
      g.setAttribute('data-provider', p.provider);
      el('rect', {class: 'box', width: it.w, height: it.h, rx: 4, fill: colour, 'fill-opacity': it.kind === 'part' ? 0.55 : 0.8}, g);
      el('text', {x: 8, y: 14, 'font-weight': 'bold'}, g).textContent = it.label;
      el('text', {x: 8, y: 27}, g).textContent = it.sub || '';
      if (it.kind === 'node') {
        g.setAttribute('data-node', it.id);
        title.textContent = nodeTitle(it.nodes[0]);
      } else {
        g.setAttribute('data-partition', p.name);
        let t = p.name + ' on ' + p.provider + ': ' + p.nodes.length + ' node(s); click to expand\n' + p.nodes.slice(0, 12).join(', ') + (p.nodes.length > 12 ? ', \u2026' : '');
        fallbacks.forEach(n => { t += '\n' + nodeTitle(n); });
        if (D.partition_seams[p.name] !== undefined) t += '\ncapture seam (runs eagerly): ' + D.partition_seams[p.name];
        else seams.forEach(n => { if (!D.fallbacks[n.name]) t += '\n' + nodeTitle(n); });
        title.textContent = t;
        g.addEventListener('click', () => { expanded.add(p.name); draw(); });
      }
      let badge = 0;
      if (fallbacks.length) { el('text', {x: it.w - 14 - badge, y: 14, fill: '#c00', 'font-weight': 'bold'}, g).textContent = '!'; badge += 12; }
      if (seams.length) { el('text', {x: it.w - 16 - badge, y: 14, 'font-weight': 'bold'}, g).textContent = '\u2016'; }
    });
    const right = LEFT + width;
    edges.forEach(e => {
      const sx = e.from.x + e.from.w / 2, sy = e.from.y + e.from.h, tx = e.to.x + e.to.w / 2, ty = e.to.y;
      const span = ty - sy;
      let d;
      if (span > 3 * (H + VGAP)) {  // long: out to the right gutter and back
        const gx = right + Math.min(GUTTER - 10, 20 + span / 40);
        d = 'M' + sx + ',' + sy + ' C' + gx + ',' + (sy + 20) + ' ' + gx + ',' + (ty - 20) + ' ' + tx + ',' + ty;
      } else {
        const c = Math.max(10, span / 2);
        d = 'M' + sx + ',' + sy + ' C' + sx + ',' + (sy + c) + ' ' + tx + ',' + (ty - c) + ' ' + tx + ',' + ty;
      }
      const path = el('path', {class: 'edge' + (e.transfer ? ' transfer' : ''), d: d, 'marker-end': 'url(#arrow)'}, edgeLayer);
      const moved = e.values.filter(v => transfers.has(v)).map(v => transfers.get(v));
      el('title', {}, path).textContent = e.values.join(', ') + moved.map(t => '\ntransfer ' + t[0] + ': ' + t[1] + ' \u2192 ' + t[2]).join('');
      if (e.transfer) {
        const label = el('text', {x: (sx + tx) / 2 + 6, y: (sy + ty) / 2, fill: '#d00', 'font-weight': 'bold'}, edgeLayer);
        label.textContent = '\u21c4 ' + moved.map(t => t[1] + '\u2192' + t[2]).join(', ');
      }
    });
    const defs = el('defs', {}, svg);
    const marker = el('marker', {id: 'arrow', viewBox: '0 0 8 8', refX: 8, refY: 4, markerWidth: 6, markerHeight: 6, orient: 'auto'}, defs);
    el('path', {d: 'M0,0 L8,4 L0,8 z', fill: '#8a8a8a'}, marker);
    document.getElementById('shown').textContent = list.filter(it => it.kind !== 'io').length + ' boxes shown';
  }

  document.getElementById('button-expand').addEventListener('click', () => { D.partitions.forEach(p => expanded.add(p.name)); draw(); });
  document.getElementById('button-collapse').addEventListener('click', () => { D.partitions.forEach(p => { if (p.nodes.length > 1) expanded.delete(p.name); }); draw(); });
  draw();
})();
"""


def explain_html(session: "Session", *, capture: Any = None, title: str | None = None) -> str:
    """The page: summary, legend, controls and the graph (drawn by an inline script).
    ``capture`` is what ``session.try_capture`` returned, or None."""
    data = explain_data(session, capture)
    title = title or f"plugrt placement: {session.model.graph.name or 'model'}"
    legend = " ".join(
        f'<span><span class="swatch" style="background:{colour}"></span>{html.escape(name)}</span>'
        for name, colour in data["colours"].items()
    )
    legend += (
        ' <span><span class="swatch" style="border:2px dashed #c00"></span>! fallback (hover for why)</span>'
        ' <span><span class="swatch" style="border:2px dotted #000"></span>&#8214; capture seam</span>'
        ' <span style="color:#d00">&#8644; transfer</span>'
    )
    payload = json.dumps(data).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style></head>
<body>
{_summary_html(data, title)}
<div class="legend">{legend}</div>
<div class="controls"><button id="button-expand">expand all</button><button id="button-collapse">collapse all</button>
<span id="shown"></span> &middot; click a box to expand its partition, a frame's title to collapse it; hover for details</div>
<div id="graph"><noscript>the graph needs JavaScript; the summary above does not</noscript></div>
<script type="application/json" id="explain-data">{payload}</script>
<script>{_SCRIPT}</script>
</body></html>
"""


def write_explain(
    model: str | os.PathLike,
    path: str | os.PathLike,
    *,
    device: str = "auto",
    capture: bool = True,
    options: dict[str, Any] | None = None,
) -> "tuple[Session, Any]":
    """Build a session, try a capture on example inputs (to find the seams), write the page.

    Returns the session and what ``try_capture`` returned (None when not tried or when
    the model cannot run on made-up inputs)."""
    from .session import load

    session = load(model, device=device, **dict(options or {}))
    result = try_capture_as_run_does(session) if capture else None
    title = f"plugrt placement: {os.path.basename(os.fspath(model))}"
    with open(path, "w", encoding="utf-8") as f:
        f.write(explain_html(session, capture=result, title=title))
    return session, result


def try_capture_as_run_does(session: "Session") -> Any:
    """What ``session.try_capture`` returns on the inputs ``plugrt run`` generates (declared
    shapes, seeded non-zero values), or None when the model cannot run on them. On other
    inputs (zeros) an ``out=`` kernel may round differently from its eager form and show
    seams a real run does not have. The capture is dropped again."""
    from .errors import PlugrtError
    from .inputs import example_inputs

    try:
        return session.try_capture(example_inputs(session.inputs))
    except PlugrtError:
        return None  # such a model is still explained, without seams
    finally:
        session.reset()


def add_parser(sub: Any) -> None:
    """The ``plugrt explain`` subcommand."""
    explain = sub.add_parser("explain", help="show where each node runs: a text summary, or an HTML picture")
    explain.add_argument("model", help="path to an .onnx file")
    explain.add_argument("--device", default="auto", help="auto, cpu, gpu, gpu:N, cuda:N, a provider name or a policy")
    explain.add_argument("--html", metavar="OUT.html", help="write one self-contained HTML page (no network needed)")
    explain.add_argument(
        "--no-capture", action="store_true",
        help="do not try a capture on the inputs 'plugrt run' generates (no seams shown)",
    )
    explain.add_argument("--optimization", default="all", choices=["none", "basic", "all"])
    explain.add_argument(
        "--placement", default="estimate", choices=["estimate", "priority", "measure"],
        help="how 'auto' and the speed policies place nodes; measure times the candidate plans on generated "
        "inputs and shows measured time per partition",
    )
    explain.set_defaults(func=_cmd_explain)


def _cmd_explain(args: Any) -> int:
    from .session import load

    # the placement explained is the final one: the device plan, not the CPU's while it compiles
    options = {"optimization": args.optimization, "placement": args.placement, "wait_for_device": True}
    capture = not args.no_capture
    if args.html:
        session, result = write_explain(args.model, args.html, device=args.device, capture=capture, options=options)
    else:
        session = load(args.model, device=args.device, **options)
        result = try_capture_as_run_does(session) if capture else None
    print(session.placement.summary())
    parts = _capture_parts(result)
    if parts is not None:
        print(f"capture: {parts[0]} segment(s), {len(parts[1])} seam(s) run eagerly")
    if args.html:
        print(f"wrote {args.html}")
    return 0
