"""Smoke tests of tests/comfy_env.py against a real ComfyUI checkout (skipped without one).

Marked ``comfyui`` as a whole: scripts/test runs this file against every ComfyUI root (the few tests here that
need no ComfyUI take milliseconds)."""

import importlib
import os
import re
import subprocess
import sys
import textwrap
import types
import uuid
from pathlib import Path

import pytest

from support import comfy_env

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def comfy_root():
    return comfy_env.require_comfyui()


# ---------------------------------------------------------------------------------------------- set-up

def test_find_comfyui_order(tmp_path, monkeypatch):
    fake = tmp_path / "ComfyUI"
    (fake / "comfy").mkdir(parents=True)
    (fake / "nodes.py").write_text("")
    (fake / "execution.py").write_text("")
    pack = fake / "custom_nodes" / "pack"
    pack.mkdir(parents=True)
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    assert comfy_env.find_comfyui(repo_root=pack) == fake.resolve()
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path / "nowhere"))
    assert comfy_env.find_comfyui(repo_root=pack) is None          # explicit but wrong: not replaced
    monkeypatch.setenv("COMFYUI_PATH", str(fake))
    assert comfy_env.find_comfyui(repo_root=tmp_path) == fake.resolve()


def _fake_comfy(path):
    (path / "comfy").mkdir(parents=True)
    (path / "nodes.py").write_text("")
    (path / "execution.py").write_text("")
    return path


def test_find_comfyui_takes_the_first_listed_root(tmp_path, monkeypatch):
    a, b = _fake_comfy(tmp_path / "a"), _fake_comfy(tmp_path / "b")
    monkeypatch.setenv("COMFYUI_PATH", os.pathsep.join([str(a), str(b)]))
    assert comfy_env.find_comfyui(repo_root=tmp_path) == a.resolve()
    monkeypatch.setenv("COMFYUI_PATH", os.pathsep.join(["", str(tmp_path / "nowhere"), str(b)]))
    assert comfy_env.find_comfyui(repo_root=tmp_path) is None      # the first entry is wrong: not replaced
    assert comfy_env.find_comfyui(repo_root=tmp_path, environ={"COMFYUI_PATH": str(b)}) == b.resolve()


def test_split_roots(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    sep = os.pathsep
    assert comfy_env.split_roots(None) == [] and comfy_env.split_roots("") == []
    assert comfy_env.split_roots(f"{sep}{sep} ") == []
    assert comfy_env.split_roots(f"~/A{sep}{tmp_path}/B/{sep}{sep}rel") == [
        tmp_path / "A", tmp_path / "B", Path(os.path.abspath("rel"))]


def test_comfyui_roots(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(comfy_env, "DEFAULT_EXTRA_COMFYUI", ("~/ComfyUI-0.8.0",))
    pack = tmp_path / "elsewhere" / "pack"            # not installed under a ComfyUI
    pack.mkdir(parents=True)
    roots = lambda **env: comfy_env.comfyui_roots(repo_root=pack, environ=env)   # noqa: E731

    assert roots() == []                                                   # nothing anywhere
    old = _fake_comfy(home / "ComfyUI-0.8.0")
    assert roots() == [old.resolve()]                                      # the extra alone comes first
    main = _fake_comfy(home / "ComfyUI")
    assert roots() == [main.resolve(), old.resolve()]                      # auto-discovered, then the default extra
    assert roots(QKV_EXTRA_COMFYUI="") == [main.resolve()]                 # extras switched off
    third = _fake_comfy(tmp_path / "c")
    sep = os.pathsep
    assert roots(QKV_EXTRA_COMFYUI=f"{third}{sep}{main}") == [main.resolve(), third.resolve()]   # deduplicated
    # a pack installed in a ComfyUI: that one is the first root
    installed = _fake_comfy(tmp_path / "Host") / "custom_nodes" / "pack"
    installed.mkdir(parents=True)
    assert comfy_env.comfyui_roots(repo_root=installed, environ={}) == [(tmp_path / "Host").resolve(), old.resolve()]
    # COMFYUI_PATH is the whole list: the extras do not apply; wrong entries stay (their run skips, saying why)
    listed = f"{old}{sep}{tmp_path / 'nowhere'}{sep}{sep}{old}/{sep}{main}"
    assert roots(COMFYUI_PATH=listed, QKV_EXTRA_COMFYUI=str(third)) == [
        old.resolve(), tmp_path / "nowhere", main.resolve()]


def test_roots_and_missing_cli(tmp_path):
    """scripts/test's queries: `comfy_env.py roots` and `comfy_env.py missing FILE`, without importing ComfyUI."""
    a, b = _fake_comfy(tmp_path / "a"), _fake_comfy(tmp_path / "b")
    env = dict(os.environ, COMFYUI_PATH=os.pathsep.join([str(a), str(b)]))
    script = str(Path(comfy_env.__file__))
    out = subprocess.run([sys.executable, script, "roots"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [str(a.resolve()), str(b.resolve())]
    req = tmp_path / "req.txt"
    req.write_text("# comment\npytest>=1   # satisfied\nno-such-dist-qkv-test==1.0\n"
                   "pytest<1\ntorch ; python_version < '3'\n\n-r other.txt\n")
    out = subprocess.run([sys.executable, script, "missing", str(req)], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.splitlines() == ["no-such-dist-qkv-test==1.0", "pytest<1"]
    bad = subprocess.run([sys.executable, script, "nonsense"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_comfyui_test_files_are_marked():
    """Every test file that uses a ComfyUI helper carries the `comfyui` mark (module pytestmark), so that
    scripts/test runs it against every ComfyUI root (`-m comfyui`)."""
    unmarked = []
    for f in sorted(Path(__file__).parent.glob("test_*.py")):
        text = f.read_text()
        if not re.search(r"^\s*from support import (comfy_env|gguf_env)\b|require_comfyui\(", text, re.M):
            continue
        mark = re.search(r"^pytestmark\s*=\s*(\[[^\]]*\]|[^\n]*)", text, re.M)
        if mark and "pytest.mark.comfyui" in mark.group(1):
            continue
        # or: ComfyUI used only inside test functions, each of them marked (a mostly ComfyUI-free file)
        top_level = re.search(r"^(from support import (comfy_env|gguf_env)\b|\S.*require_comfyui\()", text, re.M)
        users = len(re.findall(r"^\s+from support import (comfy_env|gguf_env)\b", text, re.M))
        if top_level or text.count("@pytest.mark.comfyui") < users:
            unmarked.append(f.name)
    assert not unmarked, f"ComfyUI-backed test files without pytestmark = pytest.mark.comfyui: {unmarked}"


def test_stubs_import_anything():
    """The torchvision/torchaudio stubs (installed only when the real package does not import) make any
    submodule and attribute importable; using one raises StubUsed."""
    for name in comfy_env.STUBBABLE:
        if not getattr(sys.modules.get(name), "__comfy_env_stub__", False):
            continue                                     # the real package is installed
        sub = importlib.import_module(f"{name}.transforms.functional")
        assert sub.__spec__ is not None and sub.__comfy_env_stub__
        assert sys.modules[name].transforms.functional is sub
        mode = sub.InterpolationMode.BICUBIC                # a class attribute at import time
        with pytest.raises(comfy_env.StubUsed):
            mode()
        with pytest.raises(comfy_env.StubUsed):
            importlib.import_module(f"{name}.ops").deform_conv2d(1, 2)

        class Sub(sys.modules[name].SomeBase):               # subclassable
            pass
        with pytest.raises(comfy_env.StubUsed):
            Sub()
        with pytest.raises(AttributeError):
            sys.modules[name].__wrapped__                    # dunder look-ups stay honest


def test_setup_imports_comfyui(comfy_root):
    import comfy.cli_args
    import comfy.model_management as mm
    import nodes
    assert Path(nodes.__file__).resolve() == comfy_root / "nodes.py"
    # ComfyUI's root comes before this repo (whose `nodes/` folder must not shadow nodes.py); nodes.py
    # itself inserts ComfyUI/comfy at sys.path[0] when imported.
    assert str(comfy_root) in sys.path[:2]
    assert comfy.cli_args.args.cpu and mm.cpu_state == mm.CPUState.CPU
    tv = sys.modules.get("torchvision")
    assert tv is not None and tv.__spec__ is not None            # real module, or the stub with a spec
    assert comfy_env.setup() == comfy_root                        # idempotent
    assert comfy_env.comfyui_version()


def test_wrong_nodes_module_is_evicted(comfy_root):
    import nodes as real
    fake = types.ModuleType("nodes")
    fake.__file__ = str(comfy_env.REPO_ROOT / "nodes" / "__init__.py")   # what our folder would look like
    sys.modules["nodes"] = fake
    try:
        comfy_env.setup()
        assert "nodes" not in sys.modules                         # evicted; next import finds nodes.py
        assert sys.path[0] == str(comfy_root)
    finally:
        sys.modules["nodes"] = real                               # keep the registered node classes


# ---------------------------------------------------------------------------------------------- packs

def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_load_pack_relative_imports(comfy_root, tmp_path):
    pack = tmp_path / "qkvpack"
    _write(pack / "__init__.py", """
        from .nodes import NODE_NAME
        from .qkv_core import VALUE
        import nodes as comfy_nodes          # ComfyUI's top-level nodes.py, not ./nodes
        COMFY_NODES_FILE = comfy_nodes.__file__
    """)
    _write(pack / "nodes" / "__init__.py", "NODE_NAME = 'pack-nodes'\n")
    _write(pack / "qkv_core" / "__init__.py", "VALUE = 42\n")
    name = "comfyui_qkv_under_test_" + uuid.uuid4().hex[:8]
    mod = comfy_env.load_pack(pack, name=name)
    assert (mod.NODE_NAME, mod.VALUE) == ("pack-nodes", 42)
    assert Path(mod.COMFY_NODES_FILE).resolve() == comfy_root / "nodes.py"
    assert sys.modules[name + ".nodes"].NODE_NAME == "pack-nodes"
    assert comfy_env.load_pack(pack, name=name) is mod            # cached

    bare = tmp_path / "bare"                                      # no __init__.py yet
    _write(bare / "qkv_core" / "__init__.py", "VALUE = 7\n")
    mod2 = comfy_env.load_pack(bare, name=name + "_bare")
    import importlib
    assert importlib.import_module(mod2.__name__ + ".qkv_core").VALUE == 7


V3_PACK = """
    from comfy_api.latest import ComfyExtension, io
    from .nodes import SUFFIX

    class Probe(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id="QKVEnvProbe" + SUFFIX, display_name="QKV env probe", category="testing",
                inputs=[io.Latent.Input("samples"), io.Int.Input("tag", default=0, min=0, max=100)],
                outputs=[], is_output_node=True)

        @classmethod
        def execute(cls, samples, tag):
            s = samples["samples"]
            return io.NodeOutput(ui={"shape": list(s.shape), "tag": [tag], "std": [float(s.float().std())]})

    class TinyWan(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id="QKVEnvTinyWan" + SUFFIX, category="testing",
                inputs=[io.Combo.Input("kind", options=["t2v", "i2v"], default="t2v")],
                outputs=[io.Model.Output(), io.Conditioning.Output(display_name="positive"),
                         io.Conditioning.Output(display_name="negative"), io.Latent.Output()])

        @classmethod
        def execute(cls, kind):
            import torch
            from support import comfy_env
            m = comfy_env.make_wan(kind, dim=64, heads=2, layers=1)
            pos, neg = comfy_env.make_conds(m, kind, clip_tokens=17)
            return io.NodeOutput(m, pos, neg, {"samples": torch.zeros(1, 16, 2, 8, 8)})

    class Ext(ComfyExtension):
        async def get_node_list(self):
            return [Probe, TinyWan]

    async def comfy_entrypoint():
        return Ext()
"""


@pytest.fixture(scope="module")
def v3_pack(comfy_root, tmp_path_factory):
    suffix = "_" + uuid.uuid4().hex[:8]
    pack = tmp_path_factory.mktemp("custom_nodes") / "qkv_env_pack"
    _write(pack / "__init__.py", V3_PACK)
    _write(pack / "nodes" / "__init__.py", f"SUFFIX = {suffix!r}\n")     # a pack-local `nodes` package
    assert comfy_env.load_custom_node(pack) is True
    return suffix


def test_load_custom_node_v3(v3_pack):
    import nodes
    assert "QKVEnvProbe" + v3_pack in nodes.NODE_CLASS_MAPPINGS
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["QKVEnvProbe" + v3_pack] == "QKV env probe"
    assert "KSampler" in nodes.NODE_CLASS_MAPPINGS                      # ComfyUI's nodes, not the pack's


def test_run_prompt_core_node(v3_pack):
    prompt = {
        "1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 48, "batch_size": 2}},
        "2": {"class_type": "QKVEnvProbe" + v3_pack, "inputs": {"samples": ["1", 0], "tag": 5}},
    }
    ex = comfy_env.run_prompt(prompt)
    assert ex.success, comfy_env.execution_error(ex)
    ui = ex.history_result["outputs"]["2"]
    assert ui["shape"][0] == 2 and ui["shape"][-2:] == [6, 8] and ui["tag"] == [5]
    assert any(ev == "execution_success" for ev, _ in ex.status_messages)


def test_run_prompt_ksampler_tiny_wan(v3_pack):
    prompt = {
        "1": {"class_type": "QKVEnvTinyWan" + v3_pack, "inputs": {"kind": "i2v"}},
        "2": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["1", 1], "negative": ["1", 2], "latent_image": ["1", 3],
            "seed": 0, "steps": 2, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "3": {"class_type": "QKVEnvProbe" + v3_pack, "inputs": {"samples": ["2", 0], "tag": 1}},
    }
    ex = comfy_env.run_prompt(prompt)
    assert ex.success, comfy_env.execution_error(ex)
    ui = ex.history_result["outputs"]["3"]
    assert ui["shape"] == [1, 16, 2, 8, 8] and ui["std"][0] > 0.1


def test_run_prompt_reports_errors(v3_pack):
    probe = "QKVEnvProbe" + v3_pack
    with pytest.raises(AssertionError, match="validation"):              # missing required input
        comfy_env.run_prompt({"1": {"class_type": probe, "inputs": {"tag": 1}}})
    ex = comfy_env.run_prompt({"1": {"class_type": probe, "inputs": {"samples": {"bad": 1}, "tag": 1}}})
    assert not ex.success                                                 # the node raised at run time
    err = comfy_env.execution_error(ex)
    assert err["node_id"] == "1" and err["exception_type"].endswith("KeyError")


# ---------------------------------------------------------------------------------------------- tiny Wan

@pytest.mark.parametrize("kind", comfy_env.WAN_KINDS)
def test_wan_forward(comfy_root, kind):
    p = comfy_env.make_wan(kind)
    dm = p.model.diffusion_model
    frames, h, w = 2, 8, 6
    inp = comfy_env.make_inputs(p, kind, frames=frames, h=h, w=w, batch=2, clip_tokens=17)
    seen = []
    hook = dm.blocks[0].self_attn.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    try:
        with torch.no_grad():
            out = dm(**inp)
    finally:
        hook.remove()
    c_out = comfy_env.latent_channels(kind)
    assert out.shape == (2, c_out, frames, h, w) and torch.isfinite(out).all()
    assert seen[0] == (2, comfy_env.n_tokens(frames, h, w), 128)
    assert out.std() > 0.1

    # attention is not negligible: dropping block 0's self-attention output changes the result
    blk = dm.blocks[0].self_attn
    blk.forward = lambda x, freqs, transformer_options={}: torch.zeros_like(x)
    try:
        with torch.no_grad():
            out2 = dm(**comfy_env.make_inputs(p, kind, frames=frames, h=h, w=w, batch=2, clip_tokens=17))
    finally:
        del blk.forward
    assert (out2 - out).abs().mean() > 1e-2 * out.abs().mean()


def test_wan22_per_frame_modulation(comfy_root):
    p = comfy_env.make_wan("wan22_5b")
    dm = p.model.diffusion_model
    es = []
    hook = dm.blocks[0].register_forward_pre_hook(lambda m, a, kw: es.append(tuple(kw["e"].shape)),
                                                  with_kwargs=True)
    try:
        with torch.no_grad():
            dm(**comfy_env.make_inputs(p, frames=3, per_frame_t=True))
        mask = torch.ones(1, 1, 3, 8, 8)
        mask[:, :, 0] = 0
        out = comfy_env.run_sample(p, frames=3, steps=2, denoise_mask=mask)
    finally:
        hook.remove()
    assert es[0] == (1, 3, 6, 128)                     # per-frame e0 (B, frames, 6, C)
    assert es[-1] == (2, 3, 6, 128)                    # in sampling: cond+uncond batched, per-frame timesteps
    assert out.shape == (1, 48, 3, 8, 8)


def test_run_sample_deterministic(comfy_root):
    p = comfy_env.make_wan("t2v", layers=1)
    a = comfy_env.run_sample(p)
    b = comfy_env.run_sample(p.clone())
    assert a.shape == (1, 16, 2, 8, 8) and torch.isfinite(a).all()
    assert torch.equal(a, b)
