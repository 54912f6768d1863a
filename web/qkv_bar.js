// ComfyUI-QKV: the bar under a run report on the "QKV Attention (low VRAM)" node (web/qkv_report.js draws the
// report and calls these). No ComfyUI import here: tests/test_report_bar.py runs it in Node with a fake canvas.
//
// A report's `saving` (nodes/report.py, RunReport.saving) picks the bar:
// - "full" (or absent: reports saved before it existed): the measured peak against stock's estimated peak, green
//   on red, where both are known (a CUDA run); no bar otherwise.
// - "none": every patched module that ran, ran ComfyUI's own forward (a failed self-check, gradients on, another
//   node's hook): a grey bar that says so and names them; never a share of stock's peak.
// - "partial": some ran ComfyUI's own forward, others the pack's: an olive-grey bar that names them.

export const GiB = 2 ** 30;
export const COLORS = {
  stock: "#553333",     // behind a saving: stock's estimated peak
  peak: "#3a8a4a",      // the measured peak, a share of stock's
  none: "#4a4a4a",      // no saving this run
  partial: "#5a5540",   // part of the saving this run
  text: "#ddd",
};

function ranStock(report) {
  const names = (report?.ran_stock ?? []).map((entry) => entry?.what).filter(Boolean);
  return names.length ? `${names.join(", ")} ran ComfyUI's own` : "ComfyUI's own forwards ran";
}

// What the bar shows for `report`, or null for no bar:
// {kind: "saving" | "none" | "partial", saving: bool, background, fill (0-1), fillColor, text}
export function barState(report) {
  if (!report) return null;
  const saving = report.saving ?? "full";
  if (saving === "none" || saving === "partial") {
    const what = saving === "none" ? "no saving this run" : "part of the saving this run";
    return { kind: saving, saving: false, background: COLORS[saving], fill: 0, fillColor: null,
             text: `${what}: ${ranStock(report)}` };
  }
  const peak = report.peak_bytes;
  const stock = report.stock_estimate_bytes;
  if (!Number.isFinite(peak) || !Number.isFinite(stock) || stock <= 0) return null;
  const share = Math.min(1, peak / stock);
  const text = `peak ${(peak / GiB).toFixed(2)} GiB of stock's ~${(stock / GiB).toFixed(2)} GiB` +
    ` (${Math.round(share * 100)}%)`;
  return { kind: "saving", saving: true, background: COLORS.stock, fill: share, fillColor: COLORS.peak, text };
}

// `text` cut to `width` on `ctx` (its current font), with an ellipsis where it was cut.
export function fitText(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let cut = text;
  while (cut.length > 1 && ctx.measureText(`${cut}…`).width > width) cut = cut.slice(0, -1);
  return `${cut}…`;
}

// Draws `state` (barState's) at (x, y), `width` wide: the bar, then its text on the line below.
export function drawBar(ctx, state, x, y, width, barHeight, lineHeight) {
  ctx.fillStyle = state.background;
  ctx.fillRect(x, y, width, barHeight);
  if (state.fillColor && state.fill > 0) {
    ctx.fillStyle = state.fillColor;
    ctx.fillRect(x, y, width * state.fill, barHeight);
  }
  ctx.fillStyle = COLORS.text;
  ctx.fillText(fitText(ctx, state.text, width), x, y + barHeight + lineHeight - 2);
}
