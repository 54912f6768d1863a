"""Test helper: tiny random-weight Wan models with GGUF-quantized weights, through the real ComfyUI-GGUF pack.

Imported by the tests as ``from support import gguf_env``. Nothing of city96/ComfyUI-GGUF is copied
here: its folder is found at run time and imported under a private package name; the quantized bytes come from
the ``gguf`` PyPI package (``gguf.quants.quantize``) or, for the K-quants that package cannot quantize, from the
small reference packers below (checked against ``gguf.quants.dequantize``).

Where ComfyUI-GGUF is looked for (``find_gguf_pack``):
  1. ``$COMFYUI_GGUF_PATH`` (explicit: a wrong path is not replaced by another);
  2. ``<ComfyUI root>/custom_nodes/ComfyUI-GGUF`` (the root that ``comfy_env.find_comfyui`` finds);
  3. ``~/ComfyUI-GGUF``.
``require_gguf()`` skips the test (with the reason) when the pack, the ``gguf`` module or ComfyUI is missing.

How ``make_gguf_wan`` builds the model (what ComfyUI-GGUF's ``UnetLoaderGGUF.load_unet`` does, minus the file):
  * the float32 model of ``comfy_env.make_wan(kind, ...)`` (same config, same seed) gives the weights;
  * its state dict becomes what ``loader.gguf_sd_loader`` returns: every tensor a ``GGMLTensor``; the selected
    2-D Linear weights of the transformer blocks quantized (``tensor_type`` = the GGML type, data = the raw
    uint8 blocks, (out, bytes per row); ``tensor_shape`` = the logical (out, in)), all others F32; the largest
    quantized tensor marked ``is_largest_weight``;
  * the same model config with ``model_config.custom_operations = GGMLOps()`` (what ``load_unet`` passes to
    ``comfy.sd.load_diffusion_model_state_dict`` as ``model_options["custom_operations"]``), float32 inference
    dtype, ``model_config.get_model`` then ``model.load_model_weights`` (GGMLLayer's ``_load_from_state_dict``
    takes the GGMLTensors as Parameters, no copy into an empty float weight);
  * wrapped the way ``load_unet`` does: ``GGUFModelPatcher.clone(ModelPatcher(model, ...))``.

``make_gguf_wan(..., via_file=True)`` instead writes a real ``.gguf`` file (``gguf.GGUFWriter``, arch "wan") and
calls the pack's own ``UnetLoaderGGUF().load_unet`` on it (ComfyUI's model detection then picks the config: it
sets num_heads = dim // 128, so the model must have head_dim 128).

What ComfyUI-GGUF does with such a layer (ops.py, commit 795e451), for the tests' and the pack's sake:
  * ``layer.weight`` is a ``GGMLTensor``: a torch.Tensor subclass holding the raw uint8 blocks, whose
    ``.shape`` property reports the logical shape (``tensor_shape``); ``.to()`` keeps the GGML attributes.
  * the layer's own method ``layer.cast_bias_weight(x)`` (GGMLLayer) dequantizes: ``get_weight`` ->
    ``dequantize_tensor`` -> a plain float tensor of the logical shape, LoRA patches applied.
  * the module function ``comfy.ops.cast_bias_weight(layer, x)`` knows nothing of GGML: it returns the raw
    blocks cast to x's dtype (a GGMLTensor of storage shape (out, bytes per row) that still *claims* (out, in)),
    so ``F.linear`` on it fails with "mat1 and mat2 shapes cannot be multiplied".
  * LoRA: ``GGUFModelPatcher.patch_weight_to_device`` never merges into a quantized weight; it sets
    ``weight.patches = [(patches, key)]`` on a copy of the GGMLTensor and puts that copy on the module
    (``load`` always passes ``force_patch_weights=True``, so the same happens in low-VRAM loads: no
    ``weight_function``/``LowVramPatch`` on GGUF layers). ``GGMLLayer.get_weight`` applies them after
    dequantizing, with ``comfy.lora.calculate_weight(patch_list, weight, key)``. F32 (non-quantized) weights
    are patched in place like ComfyUI does.
"""

from __future__ import annotations


import importlib
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import types
from pathlib import Path

from support import comfy_env

ENV_VAR = "COMFYUI_GGUF_PATH"
PACK_DIR_NAME = "ComfyUI-GGUF"
# Private package name for the pack: never "ComfyUI-GGUF" (ComfyUI's own loader's name) nor "nodes"/"ops".
PACKAGE = "comfy_env_gguf_pack"

# Quantized along the last (input) dimension in blocks of this many values.
BLOCK_SIZES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "BF16": 1, "Q4_K": 256, "Q6_K": 256}
QTYPES = tuple(BLOCK_SIZES)
# make_wan sizes whose block Linear layers quantize with each block size (dim and ffn_dim multiples of it).
# 256-blocks: dim 256, 4 heads of 64 (a valid Wan RoPE split); via_file needs head_dim 128 (2 heads).
DIMS_32 = dict(dim=128, heads=4, ffn_dim=256)
DIMS_256 = dict(dim=256, heads=4, ffn_dim=512)

_state = {"package": None, "root": None}


# --------------------------------------------------------------------------------------------------
# Finding and importing the pack
# --------------------------------------------------------------------------------------------------

def _is_pack(path) -> bool:
    p = Path(path)
    return all((p / f).is_file() for f in ("ops.py", "loader.py", "dequant.py", "nodes.py"))


def find_gguf_pack():
    """Path of a ComfyUI-GGUF checkout, or None. Order: $COMFYUI_GGUF_PATH, <ComfyUI>/custom_nodes/ComfyUI-GGUF,
    ~/ComfyUI-GGUF."""
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env).expanduser().resolve()
        return p if _is_pack(p) else None          # an explicit path that is wrong is not silently replaced
    root = comfy_env.find_comfyui()
    candidates = [root / "custom_nodes" / PACK_DIR_NAME] if root is not None else []
    candidates.append(Path.home() / PACK_DIR_NAME)
    for c in candidates:
        if _is_pack(c):
            return c.resolve()
    return None


def _not_found_reason():
    env = os.environ.get(ENV_VAR)
    if env:
        return f"{ENV_VAR}={env!r} is not a ComfyUI-GGUF checkout (needs ops.py, loader.py, dequant.py, nodes.py)"
    return (f"ComfyUI-GGUF not found (set {ENV_VAR}, install it as <ComfyUI>/custom_nodes/{PACK_DIR_NAME}, "
            f"or put it at ~/{PACK_DIR_NAME})")


def import_gguf_pack(path=None):
    """The pack as package ``comfy_env_gguf_pack`` (an empty package over its folder: its ``__init__.py``, which
    registers nodes, is not run; submodules import on demand with their relative imports working).

    Needs ComfyUI importable (``comfy_env.setup()`` is called). Raises ImportError with the reason."""
    comfy_env.setup()
    root = Path(path).resolve() if path is not None else find_gguf_pack()
    if root is None:
        raise ImportError(_not_found_reason())
    cached = sys.modules.get(PACKAGE)
    if cached is not None and _state["root"] == root:
        return cached
    for k in [k for k in sys.modules if k == PACKAGE or k.startswith(PACKAGE + ".")]:
        del sys.modules[k]
    module = types.ModuleType(PACKAGE)
    module.__spec__ = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
    module.__spec__.submodule_search_locations = [str(root)]
    module.__path__ = [str(root)]
    module.__package__ = PACKAGE
    module.__file__ = None
    sys.modules[PACKAGE] = module
    _state.update(package=module, root=root)
    return module


def pack_module(name):
    """A submodule of the imported pack: "ops", "dequant", "loader", "nodes" (nodes imports ComfyUI's nodes)."""
    if _state["package"] is None or sys.modules.get(PACKAGE) is not _state["package"]:
        import_gguf_pack()
    return importlib.import_module(f"{PACKAGE}.{name}")


def require_gguf():
    """ComfyUI-GGUF's ``ops`` module (GGMLOps, GGMLLayer, GGMLTensor), or pytest.skip(reason) when ComfyUI, the
    pack or the ``gguf`` module is missing (or the pack does not import against this ComfyUI)."""
    import pytest
    comfy_env.require_comfyui()
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the gguf package is not installed (pip install gguf): {e}")
    if find_gguf_pack() is None:
        pytest.skip(_not_found_reason())
    try:
        import_gguf_pack()
        return pack_module("ops")
    except Exception as e:   # noqa: BLE001 - any failure to import the pack is a reason to skip, said as such
        pytest.skip(f"ComfyUI-GGUF at {find_gguf_pack()} does not import: {type(e).__name__}: {e}")


# --------------------------------------------------------------------------------------------------
# Quantizing
# --------------------------------------------------------------------------------------------------

def qtype_enum(qtype):
    import gguf
    return qtype if isinstance(qtype, gguf.GGMLQuantizationType) else gguf.GGMLQuantizationType[str(qtype)]


def block_size(qtype):
    import gguf
    return gguf.GGML_QUANT_SIZES[qtype_enum(qtype)][0]


def dims_for(qtype):
    """make_wan sizes (dim, heads, ffn_dim) whose block Linear layers can be quantized with ``qtype``."""
    return dict(DIMS_256 if block_size(qtype) > 32 else DIMS_32)


def _f16(x):
    import numpy as np
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _pack_q4_k(blocks):
    """Q4_K blocks (n, 256) float32 -> (n, 144) uint8. A plain min/max quantizer (not llama.cpp's search), in
    the layout gguf.quants.Q4_K.dequantize_blocks reads: d, dmin (f16), 12 bytes of 6-bit scales and mins
    for the 8 sub-blocks of 32, 128 bytes of 4-bit values (sub-blocks 2i, 2i+1 in the low, high nibbles of
    bytes 32i..32i+31). x = d * sc[j] * q - dmin * m[j]."""
    import numpy as np
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = np.maximum(sub.max(axis=-1), lo)
    scale, mins = (hi - lo) / 15.0, -lo
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16(mins.max(axis=-1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.rint(mins / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((sub + (dminf * m)[..., None]) / step), 0).clip(0, 15).astype(np.uint8)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), scales, qs], axis=1)


def _pack_q6_k(blocks):
    """Q6_K blocks (n, 256) float32 -> (n, 210) uint8: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8
    scales (one per 16 values), d (f16); x = d * scale[e // 16] * (q - 32), q in 0..63."""
    import numpy as np
    n = blocks.shape[0]
    grp = blocks.reshape(n, 16, 16).astype(np.float32)
    gscale = np.abs(grp).max(axis=-1) / 31.0
    d = _f16(gscale.max(axis=-1) / 127.0)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(gscale / df), 0).clip(0, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint(grp / step), 0).clip(-32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 256)
    low, high = q & 0x0F, q >> 4
    # element e: ql byte (e // 128) * 64 + e % 64, nibble (e % 128) // 64; qh byte (e // 128) * 32 + e % 32,
    # bits 2 * ((e % 128) // 32)
    low = low.reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = high.reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8).reshape(n, 16), d.reshape(n, 1).view(np.uint8)], axis=1)


_OWN_PACKERS = {"Q4_K": _pack_q4_k, "Q6_K": _pack_q6_k}


def quantize_array(array, qtype):
    """float array (..., in) -> raw GGML blocks, uint8 (..., bytes per row), like GGUF files hold them."""
    import numpy as np
    import gguf
    qt = qtype_enum(qtype)
    a = np.ascontiguousarray(array, dtype=np.float32)
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    if a.shape[-1] % bs:
        raise ValueError(f"{qt.name} needs the last dimension to be a multiple of {bs}, got {a.shape}")
    packer = _OWN_PACKERS.get(qt.name)
    if packer is None:
        return gguf.quants.quantize(a, qt)      # NotImplementedError for types gguf cannot quantize in numpy
    rows = packer(a.reshape(-1, bs))
    return rows.reshape(*a.shape[:-1], a.shape[-1] // bs * ts)


def quantize_tensor(weight, qtype):
    """A float torch tensor -> ComfyUI-GGUF ``GGMLTensor`` of raw blocks (what ``gguf_sd_loader`` makes)."""
    import torch
    ops = pack_module("ops")
    qt = qtype_enum(qtype)
    data = torch.from_numpy(quantize_array(weight.detach().float().cpu().numpy(), qt))
    return ops.GGMLTensor(data, tensor_type=qt, tensor_shape=torch.Size(weight.shape))


def f32_tensor(t):
    """A float tensor as the loader hands over an F32 GGUF tensor: ``GGMLTensor`` with tensor_type F32."""
    import gguf
    ops = pack_module("ops")
    t = t.detach().clone()
    return ops.GGMLTensor(t, tensor_type=gguf.GGMLQuantizationType.F32, tensor_shape=t.shape)


def dequantize(t, dtype=None, dequant_dtype=None):
    """ComfyUI-GGUF's own dequantization (``dequant.dequantize_tensor``) to a plain float tensor (float32).

    ``dequant_dtype=None`` is what a GGMLOps layer does by default (the loader's "default"): the block math
    runs in the dtype of the blocks' scales (float16 for Q8_0 / Q4_K / ...), then the result is cast, i.e. the
    weight carries float16 round-off against gguf's float32 numpy dequantizer; ``torch.float32`` matches
    that one exactly."""
    import torch
    dq = pack_module("dequant")
    out = dq.dequantize_tensor(t, dtype or torch.float32, dequant_dtype)
    return torch.Tensor(out) if type(out) is not torch.Tensor else out


def is_quantized(t):
    return pack_module("dequant").is_quantized(t)


def default_quantize_key(key, value, qtype):
    """The keys ``make_gguf_wan`` quantizes by default: 2-D ``.weight`` of the Linear layers of the transformer
    blocks (``blocks.N.`` and VACE's ``vace_blocks.N.``: self/cross attention q, k, v, o, i2v's k_img, v_img,
    ffn.0, ffn.2, VACE's before/after_proj) whose input size is a multiple of the block size."""
    if not key.endswith(".weight") or value.ndim != 2:
        return False
    if not (key.startswith("blocks.") or key.startswith("vace_blocks.")):
        return False
    return value.shape[-1] % block_size(qtype) == 0


def gguf_state_dict(float_sd, qtype="Q8_0", quantize_key=None):
    """{key: GGMLTensor} as ``loader.gguf_sd_loader`` returns it: selected keys quantized, others F32; the
    largest quantized tensor marked ``is_largest_weight`` (the loader's VRAM-estimate hint)."""
    quantize_key = quantize_key or default_quantize_key
    out = {}
    for k, v in float_sd.items():
        out[k] = quantize_tensor(v, qtype) if quantize_key(k, v, qtype) else f32_tensor(v)
    quantized = [k for k, v in out.items() if is_quantized(v)]
    if quantized:
        largest = max(quantized, key=lambda k: out[k].numel())
        out[largest].is_largest_weight = True
    return out


# --------------------------------------------------------------------------------------------------
# Tiny GGUF Wan models
# --------------------------------------------------------------------------------------------------

def _resolve_dims(qtype, kwargs):
    dims = dims_for(qtype)
    for k, v in dims.items():
        kwargs.setdefault(k, v)
    return kwargs


def _new_ops(dequant_dtype=None, patch_dtype=None):
    """``GGMLOps()`` set up as ``UnetLoaderGGUF.load_unet`` does with its defaults (these are class
    attributes of GGMLOps.Linear: the loader sets them globally too)."""
    ops = pack_module("ops").GGMLOps()
    ops.Linear.dequant_dtype = dequant_dtype
    ops.Linear.patch_dtype = patch_dtype
    return ops


def make_gguf_wan(qtype="Q8_0", kind="t2v", quantize_key=None, via_file=False, patch_on_device=None,
                  **make_wan_kwargs):
    """The tiny Wan of ``comfy_env.make_wan(kind, **make_wan_kwargs)`` with GGUF weights, as a
    ``GGUFModelPatcher`` built with ComfyUI-GGUF's ``GGMLOps`` (see the module docstring for how).

    qtype: "Q8_0" (default), "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16" (gguf.quants.quantize), "Q4_K", "Q6_K"
    (packed here). dim / heads / ffn_dim default to ``dims_for(qtype)`` (multiples of the block size).
    quantize_key(key, tensor, qtype) -> bool picks the keys (default ``default_quantize_key``).
    via_file: write a .gguf file and load it with the pack's ``UnetLoaderGGUF().load_unet`` (needs heads =
    dim // 128, what ComfyUI's detection assumes).

    The patcher carries: ``comfy_env_kind``, ``gguf_qtype`` (name), ``gguf_keys`` (the quantized keys, as
    diffusion-model keys), ``gguf_dims`` (the make_wan keyword arguments used) and ``gguf_float_sd`` (the
    float32 state dict it was quantized from)."""
    require_gguf()
    import torch
    import comfy.model_patcher
    qt = qtype_enum(qtype)
    kwargs = _resolve_dims(qt.name, dict(make_wan_kwargs))
    device = torch.device(kwargs.get("device", "cpu"))
    reference = comfy_env.make_wan(kind, **kwargs)
    float_sd = {k: v.detach().clone() for k, v in reference.model.diffusion_model.state_dict().items()}
    sd = gguf_state_dict(float_sd, qt, quantize_key)
    keys = sorted(k for k, v in sd.items() if is_quantized(v))
    nodes_mod = pack_module("nodes")

    if via_file:
        patcher = _load_via_file(sd, kwargs, patch_on_device)
    else:
        model_config = reference.model.model_config          # same class and unet config as make_wan's
        cls = type(model_config)
        model_config = cls(dict(model_config.unet_config))
        dtype = kwargs.get("dtype") or torch.float32
        model_config.set_inference_dtype(dtype, None)
        model_config.custom_operations = _new_ops()
        model = model_config.get_model(sd, "", device=device)
        model.load_model_weights(dict(sd), "")
        model.eval()
        base = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)
        patcher = nodes_mod.GGUFModelPatcher.clone(base)
        patcher.patch_on_device = patch_on_device
    del reference
    patcher.comfy_env_kind = kind
    patcher.gguf_qtype = qt.name
    patcher.gguf_keys = keys
    patcher.gguf_dims = kwargs
    patcher.gguf_float_sd = float_sd
    return patcher


def as_gguf(patcher, qtype="Q8_0"):
    """Any family's tiny model (a ModelPatcher built from ComfyUI's own config class) rebuilt with ComfyUI-GGUF's
    ``GGMLOps`` and its Linear weights quantized to ``qtype`` (those whose input size is a multiple of the block
    size; the rest F32), as ``make_gguf_wan`` does for Wan: a ``GGUFModelPatcher``."""
    require_gguf()
    import torch
    qt = qtype_enum(qtype)
    model = patcher.model
    linear = {f"{name}.weight" for name, m in model.diffusion_model.named_modules() if isinstance(m, torch.nn.Linear)}
    float_sd = {k: v.detach().clone() for k, v in model.diffusion_model.state_dict().items()}
    sd = gguf_state_dict(float_sd, qt, lambda key, value, q: key in linear and value.ndim == 2
                         and value.shape[-1] % block_size(q) == 0)
    out = rebuilt_gguf_patcher(model, sd)
    out.gguf_keys = sorted(k for k, v in sd.items() if is_quantized(v))
    return out


def rebuilt_gguf_patcher(model, sd):
    """`model` (a BaseModel built from ComfyUI's config class) rebuilt from the GGUF state dict `sd` with
    ComfyUI-GGUF's ``GGMLOps``, float32 compute, on the CPU: a ``GGUFModelPatcher``."""
    import torch
    import comfy.model_patcher
    config = type(model.model_config)(dict(model.model_config.unet_config))
    config.set_inference_dtype(torch.float32, None)
    config.custom_operations = _new_ops()
    rebuilt = config.get_model(sd, "", device=torch.device("cpu"))
    rebuilt.load_model_weights(dict(sd), "")
    rebuilt.eval()
    base = comfy.model_patcher.ModelPatcher(rebuilt, load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))
    return pack_module("nodes").GGUFModelPatcher.clone(base)


def write_gguf_file(path, sd, arch="wan"):
    """Write {key: GGMLTensor} to a .gguf file (keys with ComfyUI's "model.diffusion_model." prefix stripped,
    as city96's convert.py writes them)."""
    import gguf
    import numpy as np
    import torch
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for k, v in sd.items():
        data = v.as_subclass(torch.Tensor).detach().cpu().numpy()
        qt = getattr(v, "tensor_type", gguf.GGMLQuantizationType.F32)
        if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(k, np.ascontiguousarray(data))
        else:
            writer.add_tensor(k, np.ascontiguousarray(data), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _load_via_file(sd, kwargs, patch_on_device):
    """The pack's own node: UnetLoaderGGUF().load_unet on a .gguf file written from ``sd``."""
    from unittest import mock
    import folder_paths
    dim, heads = kwargs["dim"], kwargs["heads"]
    if dim // 128 != heads:
        raise ValueError(f"via_file: ComfyUI's Wan detection sets num_heads = dim // 128 = {dim // 128}, "
                         f"not {heads}; use heads={dim // 128}")
    nodes_mod = pack_module("nodes")
    tmp = Path(tempfile.mkdtemp(prefix="gguf_env_"))
    path = write_gguf_file(tmp / "tiny_wan.gguf", sd)
    real = folder_paths.get_full_path

    def get_full_path(folder, name):
        return str(path) if name == path.name else real(folder, name)

    # The model's tensors stay mmapped from the file: the temp dir is left in place (it is tiny).
    with mock.patch.object(folder_paths, "get_full_path", get_full_path):
        (patcher,) = nodes_mod.UnetLoaderGGUF().load_unet(path.name, patch_on_device=patch_on_device)
    return patcher


def make_dequantized_wan(gguf_patcher):
    """A float32 ``ModelPatcher`` (stock ops) of the same Wan whose quantized weights are exactly their
    dequantized values: compare the GGUF model against it to float round-off, not quantization error."""
    import torch
    kwargs = dict(gguf_patcher.gguf_dims)
    ref = comfy_env.make_wan(gguf_patcher.comfy_env_kind, **kwargs)
    dm = gguf_patcher.model.diffusion_model
    with torch.no_grad():
        for key in gguf_patcher.gguf_keys:
            ref.model.diffusion_model.get_parameter(key).copy_(dequantize(dm.get_parameter(key)))
    return ref


def linear_layers(patcher, quantized=True):
    """{name: module} of the diffusion model's GGMLOps Linear layers (quantized weights only by default)."""
    ops = pack_module("ops")
    out = {}
    for name, m in patcher.model.diffusion_model.named_modules():
        if isinstance(m, ops.GGMLLayer) and getattr(m, "weight", None) is not None:
            if not quantized or is_quantized(m.weight):
                out[name] = m
    return out



def under_memory_tracker():
    """ComfyUI-GGUF's layers made to run under the CPU's `MemTracker` for the duration (the benchmark's
    helper `gguf_under_memory_tracker`: measurement only, nothing computed changes)."""
    pack = comfy_env.load_pack()
    wan_block = importlib.import_module(pack.__name__ + ".benchmarks.wan_block")
    return wan_block.gguf_under_memory_tracker(pack_module("ops"))


# --------------------------------------------------------------------------------------------------
# Any family in a GGUF file's mix of types: tests/support/gguf_files.py (reachable here)
# --------------------------------------------------------------------------------------------------

from support.gguf_files import K_QUANT_FALLBACK, as_gguf_file_mix, f16_tensor  # noqa: E402,F401
