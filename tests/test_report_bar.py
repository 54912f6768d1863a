"""The bar under the node's run report (web/qkv_bar.js), run in Node with a fake canvas: a run with the whole
saving draws the peak as a share of stock's; a run in which modules ran ComfyUI's own forward (issue 34, item 4)
draws a grey bar that says so and names them, never a share. Skipped without `node` (QKV_NODE=/path picks one);
tests/test_browser.py draws the whole report in ComfyUI's frontend."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

BAR = Path(__file__).resolve().parent.parent / "web" / "qkv_bar.js"
GiB = 2 ** 30

SCRIPT = """
const bar = await import(process.argv[1]);
const calls = [];
const ctx = {
  fillStyle: "", font: "11px monospace",
  measureText: (text) => ({ width: 6 * text.length }),
  fillRect: (x, y, w, h) => calls.push({ op: "fillRect", style: ctx.fillStyle, x, y, w, h }),
  fillText: (text, x, y) => calls.push({ op: "fillText", style: ctx.fillStyle, text, x, y }),
};
const out = [];
for (const report of JSON.parse(process.argv[2])) {
  calls.length = 0;
  const state = bar.barState(report);
  if (state) bar.drawBar(ctx, state, 8, 100, Number(process.argv[3]), 12, 14);
  out.push({ state, calls: [...calls] });
}
console.log(JSON.stringify({ colors: bar.COLORS, out }));
"""


def node_binary():
    return os.environ.get("QKV_NODE") or shutil.which("node") or shutil.which("nodejs")


def draw(*reports, width=400):
    """(colors, [(state, canvas calls)]) of web/qkv_bar.js for each report payload."""
    node = node_binary()
    if node is None:
        pytest.skip("no Node.js (`node`) to run web/qkv_bar.js")
    result = subprocess.run([node, "--input-type=module", "-e", SCRIPT, BAR.as_uri(), json.dumps(reports),
                             str(width)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    return answer["colors"], [(item["state"], item["calls"]) for item in answer["out"]]


def saving_report(**fields):
    return {"lines": ["Wan (High, block bounds, backend auto), run finished"], "saving": "full",
            "peak_bytes": 12 * GiB, "stock_estimate_bytes": 16 * GiB, **fields}


NO_SAVING = {"lines": ["No saving this run: Wan block ran as ComfyUI's own (the outputs differ)"], "saving": "none",
             "ran_stock": [{"what": "Wan block", "reason": "the outputs differ"}],
             "peak_bytes": 16 * GiB, "stock_estimate_bytes": None}


def test_a_saving_is_drawn_as_the_peak_against_stock():
    colors, [(state, calls)] = draw(saving_report())
    assert state["kind"] == "saving" and state["saving"] and state["fill"] == pytest.approx(0.75)
    rects = [call for call in calls if call["op"] == "fillRect"]
    assert [(r["style"], r["w"]) for r in rects] == [(colors["stock"], 400), (colors["peak"], 300)]
    text, = [call["text"] for call in calls if call["op"] == "fillText"]
    assert text == "peak 12.00 GiB of stock's ~16.00 GiB (75%)"


def test_reports_saved_before_the_saving_field_draw_as_before():
    _, [(old, _), (none, calls)] = draw(saving_report(saving=None), {"lines": ["a planner's text"]})
    assert old["kind"] == "saving" and none is None and calls == []


@pytest.mark.parametrize("peak", [16 * GiB, None], ids=["cuda", "cpu"])
def test_no_saving_is_grey_and_names_what_ran_stock(peak):
    """A run whose self-check failed: a grey bar across, no share of stock's peak drawn (with or without a
    measured peak), and the text says that this run had no saving and what ran ComfyUI's own."""
    colors, [(state, calls)] = draw({**NO_SAVING, "peak_bytes": peak})
    assert state["kind"] == "none" and not state["saving"] and state["fill"] == 0
    rects = [call for call in calls if call["op"] == "fillRect"]
    assert [(r["style"], r["w"]) for r in rects] == [(colors["none"], 400)]
    assert colors["peak"] not in {call["style"] for call in calls}
    text, = [call["text"] for call in calls if call["op"] == "fillText"]
    assert text == "no saving this run: Wan block ran ComfyUI's own"


def test_part_of_the_saving_is_its_own_state():
    colors, [(state, calls)] = draw({**NO_SAVING, "saving": "partial", "ran_stock": [
        {"what": "Wan block", "reason": "the outputs differ"}, {"what": "Wan VACE block", "reason": "x"}]},
        width=600)
    assert state["kind"] == "partial" and not state["saving"]
    assert [call["style"] for call in calls if call["op"] == "fillRect"] == [colors["partial"]]
    assert colors["partial"] not in (colors["none"], colors["peak"], colors["stock"])
    text, = [call["text"] for call in calls if call["op"] == "fillText"]
    assert text == "part of the saving this run: Wan block, Wan VACE block ran ComfyUI's own"


def test_a_long_text_is_cut_to_the_node():
    _, [(_, calls)] = draw(NO_SAVING, width=120)   # the fake canvas: 6 px a character
    text, = [call["text"] for call in calls if call["op"] == "fillText"]
    assert text.endswith("…") and 6 * len(text) <= 120
