// ComfyUI-QKV: draws each sampling run's report on the "QKV Attention (low VRAM)" node, and the estimate of
// the "QKV VRAM Planner" node on that node.
//
// The server sends "comfyui_qkv.report" ({node: <the node's id>, report: {lines, peak_bytes,
// stock_estimate_bytes, ...}}, nodes/report.py) at the end of every run of a patched model. The report is
// kept in node.properties.qkv_report, which is saved with the workflow: it is still there after a page
// reload. The planner's text comes as its node's ui output ("text") and is kept the same way. Without a report
// the node is drawn as ComfyUI draws it. The bar under the report (web/qkv_bar.js) shows the peak against stock's
// for a run with the whole saving, and a grey bar that says so for a run in which modules ran ComfyUI's own
// forward (the report's `saving`; its first line says which and why).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { barState, drawBar } from "./qkv_bar.js";

const NODE_TYPE = "QKVAttentionPatch";
const PLANNER_TYPE = "QKVVRAMPlanner";
const EVENT = "comfyui_qkv.report";
const LINE_HEIGHT = 14;
const BAR_HEIGHT = 12;
const PAD = 8;
const MAX_LINES = 18;

function findNode(id) {
  const graph = app.graph;
  if (!graph || id === undefined || id === null) return null;
  const text = String(id);
  // nodes inside subgraphs have ids like "12:5": the last part is the node's id in its subgraph
  const local = text.includes(":") ? text.split(":").pop() : text;
  const numeric = Number(local);
  const candidates = [numeric, local];
  const graphs = [graph, ...(graph.subgraphs ? Array.from(graph.subgraphs.values()) : [])];
  for (const g of graphs) {
    for (const key of candidates) {
      const node = g?.getNodeById?.(key);
      if (node && node.type === NODE_TYPE) return node;
    }
  }
  return null;
}

function wrap(ctx, text, width) {
  const out = [];
  let line = "";
  for (const word of String(text).split(" ")) {
    const next = line ? `${line} ${word}` : word;
    if (line && ctx.measureText(next).width > width) {
      out.push(line);
      line = `  ${word}`;
    } else {
      line = next;
    }
  }
  if (line) out.push(line);
  return out;
}

// The frontend saves the open workflow (for a page reload) when its change tracker sees a change; a property
// set from a server message is not seen by itself, so say it.
function workflowChanged() {
  const tracker = app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
  (tracker?.captureCanvasState ?? tracker?.checkState)?.call(tracker);
}

function reportOf(node) {
  const report = node?.properties?.qkv_report;
  return report && Array.isArray(report.lines) ? report : null;
}

// The lines as drawn at the node's width (kept on the node for the size and for tests).
function layout(node, ctx) {
  const report = reportOf(node);
  if (!report) return [];
  ctx.save();
  ctx.font = "11px monospace";
  const width = Math.max(120, node.size[0] - 2 * PAD);
  let lines = report.lines.flatMap((line) => wrap(ctx, line, width));
  ctx.restore();
  if (lines.length > MAX_LINES) lines = [...lines.slice(0, MAX_LINES - 1), "... (the whole report is in the log)"];
  return lines;
}

function reportTop(node) {
  // below the widgets: LiteGraph keeps each widget's last drawn y and height
  let top = 0;
  for (const widget of node.widgets ?? []) {
    const y = widget.last_y ?? widget.y ?? 0;
    const h = widget.computedHeight ?? widget.computeSize?.(node.size[0])?.[1] ?? LiteGraph.NODE_WIDGET_HEIGHT ?? 20;
    top = Math.max(top, y + h);
  }
  return top + PAD;
}

function neededHeight(node, lines) {
  const report = reportOf(node);
  if (!report) return 0;
  return reportTop(node) + lines.length * LINE_HEIGHT + (barState(report) ? BAR_HEIGHT + 2 * LINE_HEIGHT : 0) + PAD;
}

function drawReport(node, ctx) {
  const report = reportOf(node);
  if (!report || node.flags?.collapsed) return;
  const lines = layout(node, ctx);
  node.qkvDrawnLines = lines;
  const need = neededHeight(node, lines);
  if (node.size[1] < need) {
    node.size[1] = need;
    node.setDirtyCanvas?.(true, true);
  }
  ctx.save();
  ctx.font = "11px monospace";
  ctx.textAlign = "left";
  ctx.fillStyle = report.fallbacks?.length ? "#e0c070" : "#bbb";
  let y = reportTop(node) + LINE_HEIGHT - 3;
  for (const line of lines) {
    ctx.fillText(line, PAD, y);
    y += LINE_HEIGHT;
  }
  const bar = barState(report);
  node.qkvDrawnBar = bar;   // kept for tests, like the lines
  if (bar) drawBar(ctx, bar, PAD, y, node.size[0] - 2 * PAD, BAR_HEIGHT, LINE_HEIGHT);
  ctx.restore();
}

app.registerExtension({
  name: "comfyui_qkv.report",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_TYPE && nodeData?.name !== PLANNER_TYPE) return;
    if (nodeData.name === PLANNER_TYPE) {
      const onExecuted = nodeType.prototype.onExecuted;
      nodeType.prototype.onExecuted = function (message) {
        const result = onExecuted?.apply(this, arguments);
        const text = [].concat(message?.text ?? []).join("\n");
        if (text) {
          this.properties = this.properties ?? {};
          this.properties.qkv_report = { lines: text.split("\n") };
          workflowChanged();
          this.setDirtyCanvas?.(true, true);
        }
        return result;
      };
    }
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const result = onDrawForeground?.apply(this, arguments);
      try {
        drawReport(this, ctx);
      } catch (error) {
        console.warn("ComfyUI-QKV: the run report could not be drawn", error);
      }
      return result;
    };
  },
  setup() {
    api.addEventListener(EVENT, (event) => {
      const { node: id, report } = event?.detail ?? {};
      const node = findNode(id);
      if (!node || !report || !Array.isArray(report.lines)) return;
      node.properties = node.properties ?? {};
      node.properties.qkv_report = report;
      workflowChanged();
      node.setDirtyCanvas?.(true, true);
      app.graph?.setDirtyCanvas?.(true, true);
    });
  },
});
