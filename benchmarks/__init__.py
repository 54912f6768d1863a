"""Benchmarks and measurement helpers of ComfyUI-QKV: not part of the node pack's runtime (`qkv_core/` and
`nodes/` never import from here; ComfyUI never imports this package).

- `bench`: the runner, `python -m benchmarks.bench` from the repository root (`scripts/bench` wraps it).
- `memory`: peak working set and time of a call (CUDA allocator / CPU MemTracker), for the runner and tests.
- `wan_block`, `wan_model`: the `--comfyui` workloads (ComfyUI's own Wan 14B block; `--whole-model`: a whole
  Wan 14B sampled through ComfyUI). They import ComfyUI and the pack's adapter (`from ..nodes.families import wan`), so
  they are imported only as submodules of a package made for the whole pack, `<pack>.benchmarks.<name>`:
  `bench` makes one (see `bench.load_pack_module`), the tests use `comfy_env.load_pack()`'s.
"""
