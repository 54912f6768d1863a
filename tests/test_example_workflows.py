"""The example workflows (example_workflows/*.json, listed by ComfyUI's template browser) against a real ComfyUI.

Each file must be a workflow as ComfyUI's frontend saves it (the UI format, version 0.4) whose links are
consistent, whose node types exist in the ComfyUI under test (its built-in nodes, the comfy_extras modules that
define the types used, and this pack as ComfyUI's loader registers it; Note / MarkdownNote / Reroute are
frontend-only) and whose widgets_values fit each node's inputs as that ComfyUI's /object_info describes them:
the frontend's widget order, the extra "control_after_generate" value after a seed, the upload widget's value
after LoadImage's image, combo values among the options (model file names excepted: none is installed here),
numbers within their bounds; input sockets and outputs as the node defines them, required inputs connected.

The files are written for the primary target (ComfyUI v0.33.0): there every widget has its value (trailing
optional ones may be left to their defaults, which the frontend fills in) and every node has its outputs. An
older ComfyUI loads them too: its frontend ignores the values of widgets it lacks, and outputs a node gained
since stay unconnected, so there trailing extra values and outputs are allowed; a node type it lacks skips that
workflow there, saying which (on v0.33.0 or newer it fails).

The structure checks (parsing, links) need no ComfyUI; the others skip without one.
"""
from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.machinery
import inspect
import json
import math
import re
import sys
import types
from pathlib import Path

import pytest

from support import comfy_env

pytestmark = pytest.mark.comfyui

EXAMPLES = comfy_env.REPO_ROOT / "example_workflows"
WORKFLOWS = sorted(EXAMPLES.glob("*.json"))
IDS = [p.stem for p in WORKFLOWS]
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute"}
PACK_TYPES = {"QKVAttentionPatch", "QKVReferenceCache"}
PRIMARY = (0, 33, 0)
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
# Third-party packages that some comfy_extras modules import at their top and that this test environment need
# not have (v0.33's nodes_post_processing, which defines ImageScaleToTotalPixels, imports kornia): stubbed only
# while such a module loads, so that its node schemas can be read; none of their code runs.
STUB_FOR_SCHEMAS = ("kornia", "spandrel", "comfy_angle", "OpenGL", "cv2", "skimage")


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def primary_or_newer():
    return comfy_env.version_tuple() >= PRIMARY


# --------------------------------------------------------------------------------------------------
# Structure (no ComfyUI needed)
# --------------------------------------------------------------------------------------------------

def check_ui_format(wf):
    assert isinstance(wf, dict)
    for key in ("last_node_id", "last_link_id", "nodes", "links", "groups", "config", "extra", "version"):
        assert key in wf, f"no {key!r}: not the UI format the frontend saves"
    assert wf["version"] == 0.4
    assert not any(k.isdigit() for k in wf), "an API-format prompt, not a UI workflow"
    node_ids = [n["id"] for n in wf["nodes"]]
    assert len(node_ids) == len(set(node_ids)), "duplicate node ids"
    assert wf["last_node_id"] >= max(node_ids)
    link_ids = [link[0] for link in wf["links"]]
    assert len(link_ids) == len(set(link_ids)), "duplicate link ids"
    assert not link_ids or wf["last_link_id"] >= max(link_ids)
    for n in wf["nodes"]:
        for key in ("id", "type", "pos", "size", "flags", "mode", "properties"):
            assert key in n, f"node {n.get('id')}: no {key!r}"
        assert len(n["pos"]) == 2 and len(n["size"]) == 2
        assert n["mode"] == 0, f"node {n['id']} ({n['type']}) is muted or bypassed"
        if n["type"] not in FRONTEND_ONLY:
            assert n["properties"].get("Node name for S&R") == n["type"], f"node {n['id']}: properties"
            assert isinstance(n.get("widgets_values", []), list)
            for inp in n.get("inputs", []):
                assert {"name", "type", "link"} <= set(inp), f"node {n['id']}: input {inp}"
            for out in n.get("outputs", []):
                assert {"name", "type", "links"} <= set(out), f"node {n['id']}: output {out}"
    for g in wf["groups"]:
        assert len(g["bounding"]) == 4 and g.get("title")
    notes = [n for n in wf["nodes"] if n["type"] in ("Note", "MarkdownNote")]
    assert any("QKV" in (n.get("widgets_values") or [""])[0] for n in notes), "no note on the QKV nodes"


def _accepts(input_type, link_type):
    return input_type in ("*", link_type) or link_type in str(input_type).split(",")


def check_links(wf):
    nodes = {n["id"]: n for n in wf["nodes"]}
    links = {}
    for link in wf["links"]:
        assert len(link) == 6, f"link {link}: [id, origin, origin_slot, target, target_slot, type] expected"
        link_id, origin, origin_slot, target, target_slot, type_ = link
        links[link_id] = link
        assert origin in nodes and target in nodes, f"link {link_id}: a node that does not exist"
        outputs, inputs = nodes[origin].get("outputs", []), nodes[target].get("inputs", [])
        assert 0 <= origin_slot < len(outputs), f"link {link_id}: origin slot {origin_slot}"
        assert 0 <= target_slot < len(inputs), f"link {link_id}: target slot {target_slot}"
        out, inp = outputs[origin_slot], inputs[target_slot]
        assert link_id in (out.get("links") or []), f"link {link_id} not in node {origin}'s output {out['name']}"
        assert inp.get("link") == link_id, f"link {link_id} not on node {target}'s input {inp['name']}"
        assert type_ == out["type"], f"link {link_id}: type {type_} from an output of type {out['type']}"
        assert _accepts(inp["type"], type_), f"link {link_id}: {type_} into input {inp['name']} ({inp['type']})"
    for n in wf["nodes"]:
        for slot, inp in enumerate(n.get("inputs", [])):
            if inp.get("link") is not None:
                link = links.get(inp["link"])
                assert link is not None, f"node {n['id']} input {inp['name']}: link {inp['link']} does not exist"
                assert (link[3], link[4]) == (n["id"], slot), f"node {n['id']} input {inp['name']}: link {link}"
        for slot, out in enumerate(n.get("outputs", [])):
            for link_id in out.get("links") or []:
                link = links.get(link_id)
                assert link is not None, f"node {n['id']} output {out['name']}: link {link_id} does not exist"
                assert (link[1], link[2]) == (n["id"], slot), f"node {n['id']} output {out['name']}: link {link}"


def test_there_are_example_workflows():
    assert len(WORKFLOWS) >= 2, f"example workflows expected in {EXAMPLES}"
    for path in WORKFLOWS:   # the template browser shows the file name as the title
        assert path.stem == path.stem.strip()


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_is_a_ui_workflow(path):
    check_ui_format(load(path))


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_links_are_consistent(path):
    check_links(load(path))


# --------------------------------------------------------------------------------------------------
# ComfyUI's node definitions
# --------------------------------------------------------------------------------------------------

class _SchemaStub(types.ModuleType):
    """A missing third-party package, present only while a comfy_extras module's schemas are read."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise ImportError(f"{self.__name__} is not installed (stubbed to read node schemas only)")


def _run(result):
    return asyncio.run(result) if inspect.isawaitable(result) else result


def _extra_module_files(root, node_type):
    """comfy_extras files that define `node_type` (V3 node_id=... or a V1 NODE_CLASS_MAPPINGS key)."""
    pattern = re.compile(r"""(node_id\s*=\s*["']{0}["']|["']{0}["']\s*:)""".format(re.escape(node_type)))
    return [f for f in sorted((root / "comfy_extras").glob("*.py")) if pattern.search(f.read_text(errors="ignore"))]


def _load_extra_module(nodes, path):
    """Load one comfy_extras module as ComfyUI's init_builtin_extra_nodes does (nodes.load_custom_node with
    module_parent comfy_extras), a missing package of STUB_FOR_SCHEMAS stubbed meanwhile. Returns None, or
    why it did not load."""
    stubbed = []
    try:
        for _ in range(len(STUB_FOR_SCHEMAS) + 1):
            try:
                importlib.import_module(f"comfy_extras.{path.stem}")
                break
            except ModuleNotFoundError as e:
                top = (e.name or "").split(".")[0]
                if top not in STUB_FOR_SCHEMAS or top in sys.modules:
                    return f"{path.name}: {type(e).__name__}: {e}"
                stub = _SchemaStub(top)
                stub.__spec__ = importlib.machinery.ModuleSpec(top, None)
                sys.modules[top] = stub
                stubbed.append(top)
        if not _run(nodes.load_custom_node(str(path), module_parent="comfy_extras")):
            return f"{path.name}: ComfyUI's loader refused it (see the log)"
        return None
    finally:
        for top in stubbed:
            sys.modules.pop(top, None)


def load_node_types():
    """ComfyUI's `nodes` module with this pack and the comfy_extras modules the workflows use loaded, and the
    types not found ({type: why})."""
    root = comfy_env.require_comfyui()
    import nodes
    if not PACK_TYPES <= set(nodes.NODE_CLASS_MAPPINGS):
        assert comfy_env.load_custom_node(comfy_env.REPO_ROOT) is True, "ComfyUI did not load the pack"
    wanted = {n["type"] for path in WORKFLOWS for n in load(path)["nodes"]} - FRONTEND_ONLY
    missing = {}
    for node_type in sorted(wanted - set(nodes.NODE_CLASS_MAPPINGS)):
        reasons = [r for r in (_load_extra_module(nodes, f) for f in _extra_module_files(root, node_type)) if r]
        if node_type not in nodes.NODE_CLASS_MAPPINGS:
            missing[node_type] = "; ".join(reasons) or "no such node"
    return nodes, missing


@pytest.fixture(scope="module")
def comfy():
    return load_node_types()


def _node_info(nodes, node_type):
    """The node's entry of ComfyUI's /object_info (server.py's node_info)."""
    cls = nodes.NODE_CLASS_MAPPINGS[node_type]
    if hasattr(cls, "GET_NODE_INFO_V1"):
        return cls.GET_NODE_INFO_V1()
    inputs = cls.INPUT_TYPES()
    return {"input": inputs, "input_order": {k: list(v) for k, v in inputs.items()},
            "output": list(cls.RETURN_TYPES)}


class Widget:
    """One widget of a node as the frontend makes it from /object_info."""

    def __init__(self, name, kind, options=None, spec=None, required=True, extra=None):
        self.name, self.kind, self.options, self.spec, self.required = name, kind, options, spec or {}, required
        self.extra = extra          # "control" (control_after_generate) / "upload" (image_upload)

    def __repr__(self):
        return self.name


def _spec(entry):
    opts = entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {}
    return entry[0], opts


def widgets_of(inputs, order=None, chosen=None):
    """The widgets of an /object_info `input` dict in the frontend's order: required, then optional; after a
    seed its control_after_generate, after an upload combo its upload button, after a dynamic combo the
    widgets of its chosen option (`chosen`: {name: value})."""
    out = []
    for section in ("required", "optional"):
        for name in (order or {}).get(section) or list(inputs.get(section, {})):
            type_, opts = _spec(inputs[section][name])
            if opts.get("forceInput") or opts.get("hidden"):
                continue
            required = section == "required"
            if isinstance(type_, list):
                out.append(Widget(name, "COMBO", list(type_), opts, required))
            elif type_ == DYNAMIC_COMBO:
                choices = {o["key"]: o.get("inputs", {}) for o in opts.get("options", [])}
                out.append(Widget(name, "COMBO", list(choices), opts, required))
                value = (chosen or {}).get(name)
                if value in choices:
                    out.extend(widgets_of(choices[value], None, chosen))
                continue
            elif type_ in WIDGET_TYPES:
                out.append(Widget(name, type_, list(opts.get("options", [])) if type_ == "COMBO" else None,
                                  opts, required))
            else:
                continue
            if opts.get("control_after_generate"):
                out.append(Widget(name + " control_after_generate", "CONTROL", None, {}, required, "control"))
            if any(opts.get(k) for k in ("image_upload", "video_upload", "audio_upload")):
                out.append(Widget(name + " upload", "UPLOAD", None, {}, required, "upload"))
    return out


def node_widgets(nodes, node):
    """(widgets, info) of a workflow node; dynamic combos resolved by the node's own widgets_values."""
    info = _node_info(nodes, node["type"])
    values, chosen = list(node.get("widgets_values") or []), {}
    dynamic = _dynamic_combos(info["input"])
    while True:
        widgets = widgets_of(info["input"], info.get("input_order"), chosen)
        new = {w.name: v for w, v in zip(widgets, values) if w.name in dynamic and w.name not in chosen}
        if not new:
            return widgets, info
        chosen.update(new)


def _dynamic_combos(inputs):
    names = set()
    for section in ("required", "optional"):
        for name, entry in inputs.get(section, {}).items():
            type_, opts = _spec(entry)
            if type_ == DYNAMIC_COMBO:
                names.add(name)
                for option in opts.get("options", []):
                    names |= _dynamic_combos(option.get("inputs", {}))
    return names


def _is_model_file(value):
    import folder_paths
    return isinstance(value, str) and Path(value).suffix.lower() in folder_paths.supported_pt_extensions


def _check_value(w, value, where):
    if w.extra == "control":
        assert value in CONTROL_VALUES, f"{where}: {value!r} is not a control_after_generate value"
    elif w.extra == "upload":
        assert isinstance(value, str), f"{where}: upload widget value {value!r}"
    elif w.kind == "COMBO":
        assert value in w.options or _is_model_file(value), f"{where}: {value!r} not among {w.options[:12]}"
    elif w.kind == "BOOLEAN":
        assert isinstance(value, bool), f"{where}: {value!r} is not a boolean"
    elif w.kind == "STRING":
        assert isinstance(value, str), f"{where}: {value!r} is not a string"
    else:   # INT, FLOAT
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), \
            f"{where}: {value!r} is not a number"
        assert w.kind == "FLOAT" or float(value).is_integer(), f"{where}: {value!r} is not an integer"
        lo, hi = w.spec.get("min"), w.spec.get("max")
        assert lo is None or value >= lo, f"{where}: {value} below its minimum {lo}"
        assert hi is None or value <= hi, f"{where}: {value} above its maximum {hi}"


def check_node_types(nodes, wf):
    for n in wf["nodes"]:
        assert n["type"] in FRONTEND_ONLY or n["type"] in nodes.NODE_CLASS_MAPPINGS, f"unknown node {n['type']}"
    assert PACK_TYPES & {n["type"] for n in wf["nodes"]}, "the workflow uses none of the pack's nodes"


def check_widgets(nodes, wf):
    for n in wf["nodes"]:
        where = f"node {n['id']} ({n['type']})"
        values = list(n.get("widgets_values") or [])
        if n["type"] in FRONTEND_ONLY:
            assert n["type"] == "Reroute" or (len(values) == 1 and isinstance(values[0], str) and values[0]), where
            continue
        widgets, _ = node_widgets(nodes, n)
        if primary_or_newer():
            assert len(values) <= len(widgets), f"{where}: {len(values)} widgets_values for the widgets {widgets}"
        for w in widgets[len(values):]:
            assert not w.required, f"{where}: no value for the required widget {w.name} (widgets {widgets})"
        for w, value in zip(widgets, values):
            _check_value(w, value, f"{where} widget {w.name}")


def check_sockets(nodes, wf):
    """Input sockets are the node's non-widget inputs (the required ones connected); outputs its outputs."""
    for n in wf["nodes"]:
        if n["type"] in FRONTEND_ONLY:
            continue
        where = f"node {n['id']} ({n['type']})"
        widgets, info = node_widgets(nodes, n)
        widget_names = {w.name for w in widgets}
        declared = {name: (_spec(entry)[0], section == "required")
                    for section in ("required", "optional") for name, entry in info["input"].get(section, {}).items()}
        for inp in n.get("inputs", []):
            name = (inp.get("widget") or {}).get("name") or inp["name"]
            assert name in declared, f"{where}: input {name!r} is not one of {sorted(declared)}"
            if "widget" in inp:
                assert name in widget_names, f"{where}: {name} is no widget"
            else:
                assert inp["type"] == declared[name][0], \
                    f"{where}: input {name} is {inp['type']}, ComfyUI says {declared[name][0]}"
        for name, (type_, required) in declared.items():
            if required and name not in widget_names and not isinstance(type_, list) \
                    and type_ not in WIDGET_TYPES | {DYNAMIC_COMBO}:
                sock = [i for i in n.get("inputs", []) if i["name"] == name]
                assert sock and sock[0].get("link") is not None, f"{where}: required input {name} not connected"
        outputs, saved = list(info["output"]), n.get("outputs", [])
        types_ = [o["type"] for o in saved]
        if primary_or_newer():
            assert types_ == outputs, f"{where}: outputs {types_}, ComfyUI says {outputs}"
        else:
            assert types_[:len(outputs)] == outputs, f"{where}: outputs {types_}, ComfyUI says {outputs}"
            assert not any(o.get("links") for o in saved[len(outputs):]), f"{where}: a newer output is connected"


def _require_types(comfy, wf, path):
    nodes, missing = comfy
    absent = {t: missing[t] for t in {n["type"] for n in wf["nodes"]} if t in missing}
    if absent:
        why = ", ".join(f"{t} ({r})" for t, r in sorted(absent.items()))
        message = f"{path.name}: ComfyUI {comfy_env.comfyui_version()} lacks {why}"
        if not primary_or_newer():
            pytest.skip(message)
        pytest.fail(message)
    return nodes


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_node_types_exist(comfy, path):
    wf = load(path)
    check_node_types(_require_types(comfy, wf, path), wf)


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_widgets_values_fit_the_inputs(comfy, path):
    wf = load(path)
    check_widgets(_require_types(comfy, wf, path), wf)


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_sockets_match_the_node_definitions(comfy, path):
    wf = load(path)
    check_sockets(_require_types(comfy, wf, path), wf)


def _node(wf, node_type, nth=0):
    return [n for n in wf["nodes"] if n["type"] == node_type][nth]


def _break_link_type(wf):
    wf["links"][0][5] = "LATENT"


def _drop_link(wf):
    wf["links"].pop()


def _swap_values(wf):
    n = _node(wf, "KSamplerAdvanced")
    n["widgets_values"][3], n["widgets_values"][5] = n["widgets_values"][5], n["widgets_values"][3]


MISTAKES = {
    "API format": (check_ui_format, lambda wf: wf.update({"3": {"class_type": "KSampler"}})),
    "muted node": (check_ui_format, lambda wf: _node(wf, "VAEDecode").update(mode=2)),
    "link type": (check_links, _break_link_type),
    "dangling link": (check_links, _drop_link),
    "unknown node": (check_node_types, lambda wf: _node(wf, "VAEDecode").update(type="VAEDecodeNoSuchNode")),
    "combo value": (check_widgets, lambda wf: _node(wf, "QKVAttentionPatch")["widgets_values"].__setitem__(0, "Max")),
    "missing value": (check_widgets, lambda wf: _node(wf, "KSamplerAdvanced")["widgets_values"].pop()),
    "no control value": (check_widgets, lambda wf: _node(wf, "KSamplerAdvanced")["widgets_values"].pop(2)),
    "shifted values": (check_widgets, _swap_values),
    "out of bounds": (check_widgets, lambda wf: _node(wf, "EmptyHunyuanLatentVideo")["widgets_values"]
                      .__setitem__(2, 0)),
    "socket type": (check_sockets, lambda wf: _node(wf, "VAEDecode")["inputs"][1].update(type="CLIP")),
    "unconnected": (check_sockets, lambda wf: _node(wf, "VAEDecode")["inputs"][1].update(link=None)),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_checks_catch_mistakes(comfy, mistake):
    """Each check refuses a copy of the Wan workflow with one mistake in it (and passes the original)."""
    path = next(p for p in WORKFLOWS if "Wan" in p.stem)
    check, spoil = MISTAKES[mistake]
    nodes = _require_types(comfy, load(path), path)
    args = (nodes,) if check in (check_node_types, check_widgets, check_sockets) else ()
    check(*args, load(path))
    wf = copy.deepcopy(load(path))
    spoil(wf)
    with pytest.raises(AssertionError):
        check(*args, wf)
