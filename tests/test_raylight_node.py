"""QKV Attention (raylight) (nodes/raylight_node.py, docs/design.md §3.7), on CPU: the node patches the model of
each of raylight's Ray actors through a stand-in of the actor that sends the patch as Ray does (cloudpickle),
checks its options before any actor is asked, and the function it sends patches a model in a fresh Python that
has ComfyUI but not this pack imported. The sequence-parallel runs themselves: tests/test_raylight.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support import comfy_env

pytestmark = [pytest.mark.comfyui, pytest.mark.sequence_parallel]


class _Actor:
    """A stand-in of raylight's Ray actor: `model_function_runner.remote(fn, *args)` sends `fn` as Ray does
    (cloudpickle: by value where its module cannot be imported there) and keeps `fn(model, *args)`."""

    def __init__(self, model):
        self.model = model
        actor = self

        class _Runner:
            @staticmethod
            def remote(fn, *args, **kwargs):
                import cloudpickle
                sent = cloudpickle.loads(cloudpickle.dumps(fn))
                actor.model = sent(actor.model, *args, **kwargs)
                return "done"
        self.model_function_runner = _Runner()


def test_the_raylight_node_patches_every_worker(monkeypatch):
    """QKV Attention (raylight) patches each actor's model (the actor keeps the patched clone), checks its options
    before any actor is asked, and a worker without a model says which node to connect first."""
    import types
    pytest.importorskip("cloudpickle")
    env = comfy_env.pack_modules()
    import importlib
    node = importlib.import_module(env.pack.__name__ + ".nodes.raylight_node")
    assert node.raylight_nodes() == ([node.QKVRaylightPatch] if node.ray_available() else [])
    schema = node.QKVRaylightPatch.define_schema()   # QKV Attention's widgets after raylight's actors
    assert [i.id for i in schema.inputs] == ["ray_actors", "head_split", "attention_backend", "block_bounds"]
    assert [o.io_type for o in schema.outputs] == ["RAY_ACTORS"]
    asked = []
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=lambda futures: asked.append(futures)))
    models = [comfy_env.make_wan("t2v", dim=128, heads=4, layers=1, text_dim=32) for _ in range(2)]
    actors = [_Actor(model) for model in models]
    node.QKVRaylightPatch.execute({"workers": actors}, "High", "sdpa", True)
    assert asked == [["done", "done"]]
    for actor, model in zip(actors, models):
        assert actor.model is not model and not model.object_patches   # a clone; the loaded model untouched
        keys = [key for key, value in actor.model.object_patches.items() if env.compat.is_ours(value)]
        assert "diffusion_model.blocks.0.forward" in keys and "diffusion_model.blocks.0.self_attn.forward" in keys
    with pytest.raises(ValueError, match="head split level must be one of"):
        node.QKVRaylightPatch.execute({"workers": actors}, "Highest", "sdpa", True)
    with pytest.raises(ValueError, match="attention backend must be one of"):
        node.QKVRaylightPatch.execute({"workers": actors}, "High", "xformers2", True)
    assert len(asked) == 1
    with pytest.raises(ValueError, match="after raylight's model loader"):
        node.QKVRaylightPatch.execute({"workers": [_Actor(None)]}, "High", "sdpa", True)


def test_the_worker_patch_runs_where_the_pack_is_not_imported(tmp_path):
    """The function the node sends, pickled as Ray pickles it, patches a model in a fresh Python that has ComfyUI
    but not this pack imported (a Ray actor's): it imports the pack from its folder under ComfyUI's name for it."""
    import subprocess
    cloudpickle = pytest.importorskip("cloudpickle")
    env = comfy_env.pack_modules()
    import importlib
    node = importlib.import_module(env.pack.__name__ + ".nodes.raylight_node")
    sent = tmp_path / "patch.pkl"
    sent.write_bytes(cloudpickle.dumps(node.worker_patch()))
    script = f"""
import sys
sys.path[:0] = [{str(Path(__file__).parent)!r}]
import cloudpickle
from support import comfy_env
comfy_env.setup()
assert {node.PACKAGE!r} not in sys.modules
patch = cloudpickle.loads(open({str(sent)!r}, "rb").read())
model = comfy_env.make_wan("t2v", dim=128, heads=4, layers=1, text_dim=32)
patched = patch(model, "High", "sdpa", True)
ours = [key for key, value in patched.object_patches.items() if getattr(value, "_qkv_patch", False)]
print("PATCHED", len(ours), sys.modules[{node.PACKAGE!r}].__file__)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PATCHED"))
    count, where = line.split()[1:]
    assert int(count) >= 3 and Path(where).resolve() == Path(node.PACK_DIR, "__init__.py").resolve(), line
