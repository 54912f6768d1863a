"""The whole-model benchmark (`benchmarks/wan_model.py`) and the block benchmark's GGUF weights, on CPU: the
frame search's logic, Q8_0 blocks as the `gguf` package writes them, one tiny sampling run through
ComfyUI's model management, stock and patched, and the families benchmark's forced split. The numbers they
exist for need CUDA (docs/benchmarks.md)."""
from __future__ import annotations

import importlib
import json

import pytest

from support import comfy_env

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def bench():
    comfy_env.require_comfyui()
    pack = comfy_env.load_pack()
    return importlib.import_module(pack.__name__ + ".benchmarks.wan_model")


@pytest.fixture
def narrow_wan(bench, monkeypatch):
    """The benchmark's Wan made 512 wide (4 heads of 128, FFN 1024) for this test: its sampling, planning
    and records are those of the 14B's, at a CPU's pace."""
    for key, value in dict(dim=512, ffn_dim=1024, num_heads=4).items():
        monkeypatch.setitem(bench.WAN_14B, key, value)


@pytest.mark.parametrize("limit,first,expected,probed", [
    (201, 81, 201, [81, 121, 161, 201]),     # fits up to the largest allowed
    (150, 81, 121, [81, 121, 161]),          # stops at the first that does not fit
    (50, 81, 41, [81, 41]),                  # the first does not fit: down until one does
    (0, 81, None, [81, 41, 1]),              # nothing fits
])
def test_frame_search(bench, limit, first, expected, probed):
    seen = []

    def fits(frames):
        seen.append(frames)
        return frames <= limit

    assert bench.search_frames(fits, first, 40, 201) == expected
    assert seen == probed


def test_q8_0_blocks_are_those_of_the_gguf_package(bench):
    gguf = pytest.importorskip("gguf")
    import torch
    from_package = importlib.import_module(bench.__name__.rsplit(".", 1)[0] + ".wan_block")
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    weight[3, :32] = 0.0                          # an all-zero block: scale 0, values 0
    ours = from_package.quantize_q8_0(weight).numpy()
    reference = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert ours.shape == reference.shape and (ours == reference).all()


def test_a_tiny_whole_model_run(bench, narrow_wan, tmp_path):
    """One narrow Wan block, a 128 x 128 latent, 1 step: both methods sample with a zeroed negative and with a
    random one, the pack's runs after their warm-up plan with its factor (unsplit at 128 tokens: 0.9), and the
    records say so."""
    out = tmp_path / "records.jsonl"
    assert bench.main(["--formats", "bf16:16", "--layers", "1", "--frames", "5", "--size", "128x128",
                       "--steps", "1", "--json", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["negative"], r["method"]) for r in records] == [
        ("zeros", "stock"), ("zeros", "pack"), ("random", "stock"), ("random", "pack")]
    assert all(r["fits"] and r["s_per_step"] > 0 for r in records)
    assert all("x0.90" in r["pack_memory_estimate"] for r in records if r["method"] == "pack")


def test_a_tiny_whole_model_run_with_the_compile_nodes_after_each_method(bench, narrow_wan, tmp_path):
    """`--compile none,whole,blocks`: the pack sampled as it is, with ComfyUI's TorchCompileModel after it and with
    its blocks compiled one by one (inductor), each record naming the way, none hitting dynamo's recompile limit."""
    out = tmp_path / "records.jsonl"
    assert bench.main(["--formats", "bf16:16", "--layers", "1", "--frames", "5", "--size", "128x128",
                       "--steps", "2", "--negatives", "zeros", "--methods", "pack", "--compile", "none,whole,blocks",
                       "--json", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["method"], r["compile"]) for r in records] == [("pack", way) for way in ("none", "whole", "blocks")]
    assert all(r["fits"] and r["s_per_step"] > 0 and "dynamo_recompile_limit" not in r for r in records)


def test_the_compile_ways_are_the_compile_nodes_wrappers(bench):
    """`compile_ways.compiled`: ComfyUI's compile wrapper on a clone, over the whole diffusion model or one key a
    block; an unknown way is refused."""
    ways = importlib.import_module(bench.__name__.rsplit(".", 1)[0] + ".compile_ways")
    patcher = comfy_env.make_wan("t2v", layers=2)
    assert ways.compiled(patcher, "none") is patcher
    whole, blocks = ways.compiled(patcher, "whole"), ways.compiled(patcher, "blocks")
    assert list(whole.model_options["torch_compile_kwargs"]) and whole is not patcher
    assert blocks.model_options["torch_compile_kwargs"]["dynamic"] is False
    assert not patcher.model_options.get("torch_compile_kwargs")
    with pytest.raises(SystemExit, match="--compile"):
        ways.compiled(patcher, "everything")


def test_both_fp8_scaled_file_layouts_load_as_quantized_weights(bench):
    """The whole-model benchmark's two fp8-scaled formats: a per-layer `comfy_quant` entry, and Comfy-Org's file
    layout (`scale_weight` per layer and a `scaled_fp8` marker) that ComfyUI's loader converts; both load through
    `comfy.sd.load_diffusion_model_state_dict` with QuantizedTensor block weights of the same values."""
    import torch
    import comfy.ops
    if not hasattr(comfy.ops, "mixed_precision_ops"):
        pytest.skip("this ComfyUI has no mixed-precision (fp8-scaled) ops")
    wan_weights = importlib.import_module(bench.__name__.rsplit(".", 1)[0] + ".wan_weights")
    config = dict(wan_weights.WAN_14B, dim=256, ffn_dim=512, num_heads=2, num_layers=1, text_dim=64)
    weights = []
    for fmt in (wan_weights.FP8_SCALED, wan_weights.FP8_SCALED_FILE):
        sd = wan_weights.wan_state_dict(fmt, config, torch.device("cpu"))
        assert ("scaled_fp8" in sd) == (fmt == wan_weights.FP8_SCALED_FILE)
        model = wan_weights.load_model(fmt, sd, dynamic=False).model.diffusion_model
        weight = model.blocks[0].self_attn.q.weight
        assert type(weight).__name__ == "QuantizedTensor", (fmt, type(weight))
        weights.append(weight.dequantize())
    assert torch.equal(*weights)


def test_the_reference_benchmark_runs_a_tiny_flux2(capsys):
    """`--references` (benchmarks/reference_steps.py) on a Flux2 of 2 heads, an 8 x 8 latent, one reference:
    every row is there, the cached steps read the cache (the run asserts it) and q8 holds about half of 16-bit."""
    comfy_env.require_comfyui()
    import comfy.supported_models
    if not hasattr(comfy.supported_models, "Flux2"):
        pytest.skip("this ComfyUI has no Flux 2 (the benchmark says so and exits)")
    pack = comfy_env.load_pack()
    steps = importlib.import_module(pack.__name__ + ".benchmarks.reference_steps")
    assert steps.main(["--heads", "2", "--side", "8", "--double", "1", "--single", "1", "--refs", "1",
                       "--repeats", "1", "--backend", "sdpa", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for row in ("| stock |", "| pack, no cache |", "| cache q8 vram: cached step |", "| cache q8 ram: cached step |",
                "| cache 16-bit vram: cached step |"):
        assert row in out
    # core's way runs on v0.33's hooks (its Flux names the reference tokens); older ComfyUI: one row says why not
    if "| core-style bf16 cache: does not run here" not in out:
        assert "| core-style bf16 cache: cached step |" in out
        assert "cached step time / the core-style bf16 cache's: q8 vram " in out
    ratio = float(out.split("q8 / 16-bit bytes ")[1].split()[0])
    assert 0.45 < ratio < 0.6


def test_the_whole_model_benchmark_runs_every_family_tiny(capsys):
    """`--family-models --tiny` (benchmarks/family_models.py): every family's whole model, cut down, runs stock
    and patched through the same calls the GPU run makes, and the pack's output matches stock's."""
    comfy_env.require_comfyui()
    pack = comfy_env.load_pack()
    models = importlib.import_module(pack.__name__ + ".benchmarks.family_models")
    status = models.main(["--tiny", "--device", "cpu", "--repeats", "1"])
    out = capsys.readouterr().out
    # the cases' models are v0.33's configurations: a release before v0.8.0 lacks some models (Kandinsky 5) or
    # their newer settings (Flux's txt_ids_dims), and the benchmark's row says it could not build that case
    older, built = comfy_env.version_tuple() < (0, 8, 0), 0
    assert status == 0 or older, out   # 1: a case failed
    for case in ("flux-dev-1024", "qwen-image-1328", "hunyuan-video-720p129", "ltxv-768x512x97", "lumina2-1024",
                 "z-image-1024", "sd35-large-1024", "sd35-medium-1024", "cosmos-p2-2b-1280x704x93",
                 "kandinsky5-lite-768x512x61", "hidream-i1-1024"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {case} |"))
        if older and any(why in row for why in ("| failed: TypeError: ", "model detection selected NoneType")):
            continue
        built += 1
        assert float(row.rstrip(" |").split("|")[-1]) < 2e-2, row   # rel diff, bf16
    assert built >= 5, out   # v0.3.64: Qwen-Image, LTX, SD3.5 Large and Medium, Cosmos, HiDream


def test_the_whole_model_benchmark_takes_a_level_and_a_split_floor(tmp_path):
    """`--family-models --level L --split-floor-tokens N`: the pack at that level, the runtime's split floor N for the
    run (a floor above the tiny model's tokens: the plan says the split does not run), the floor restored."""
    import json
    comfy_env.require_comfyui()
    pack = comfy_env.load_pack()
    models = importlib.import_module(pack.__name__ + ".benchmarks.family_models")
    head_split = importlib.import_module(pack.__name__ + ".qkv_core.head_split")
    floor = head_split.SPLIT_FLOOR_TOKENS
    out = tmp_path / "rows.json"
    assert models.main(["--tiny", "--device", "cpu", "--repeats", "1", "--cases", "qwen-image-1328", "--level",
                        "Medium", "--split-floor-tokens", "100000", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    row = report["rows"][0]
    assert (report["level"], report["split_floor_tokens"]) == ("Medium", 100000)
    assert row["plan_why"].startswith("no head split") and row["max_rel_diff"] < 2e-2
    assert head_split.SPLIT_FLOOR_TOKENS == floor


def test_the_families_benchmark_forces_the_split_where_asked():
    """`--families --split-floor-tokens 0` splits a block that the family's own floor keeps whole (a tiny Flux double
    block: 1,040 tokens), which lowers the pack's peak; either way the pack's output is stock's (float32 on CPU)."""
    import torch
    comfy_env.require_comfyui()
    pack = comfy_env.load_pack()
    blocks = importlib.import_module(pack.__name__ + ".benchmarks.family_blocks")
    case = blocks.Case("flux-tiny", "a tiny Flux double block",
                       blocks.flux_case("double", 1024, 16, width=512, heads=4))
    cpu = torch.device("cpu")
    whole = blocks.run_case(case, cpu, torch.float32, "sdpa", repeats=1, level=3)
    split = blocks.run_case(case, cpu, torch.float32, "sdpa", repeats=1, level=3, split_floor_tokens=0)
    assert whole["max_rel_diff"] < 1e-5 and split["max_rel_diff"] < 1e-5
    assert split["pack_peak_x"] < whole["pack_peak_x"] < whole["stock_peak_x"]


def test_the_families_benchmark_times_calls_back_to_back(tmp_path):
    """`--families --chain N` times N calls back to back in each run (as a model runs its blocks) and reports
    the time per call; the peaks and the outputs are those of one call. Through the command line, on a tiny
    Flux double block registered as a case (ComfyUI's Flux blocks take the same inputs in every release tested)."""
    import json
    import torch
    comfy_env.require_comfyui()
    pack = comfy_env.load_pack()
    blocks = importlib.import_module(pack.__name__ + ".benchmarks.family_blocks")
    case = blocks.Case("flux-tiny", "a tiny Flux double block",
                       blocks.flux_case("double", 1024, 16, width=512, heads=4))
    blocks.CASES["flux-tiny"] = case
    calls = []
    original = blocks._run_all
    blocks._run_all = lambda fn, inputs: (calls.append(len(inputs)), original(fn, inputs))
    try:
        out = tmp_path / "rows.json"
        assert blocks.main(["--cases", "flux-tiny", "--device", "cpu", "--repeats", "2", "--chain", "3",
                            "--split-floor-tokens", "0", "--json", str(out)]) == 0
    finally:
        blocks._run_all = original
        blocks.CASES.pop("flux-tiny")
    report = json.loads(out.read_text())
    row = report["rows"][0]
    assert report["chain"] == 3
    assert calls == [3] * 6   # stock and pack: one warm-up and two timed runs of three calls each
    assert row["pack_peak_x"] < row["stock_peak_x"] and row["max_rel_diff"] < 2e-2   # bf16
    assert row["stock_ms"] > 0 and row["pack_ms"] > 0


def test_the_families_benchmark_times_the_fast_paths_on_and_off(tmp_path):
    """`--families --fast-paths-ab`: the pack's forward timed with every fast path on, with none and with one
    off, in turns (each `--ab-rounds` times), stock's time beside; on a tiny Flux double block split on CPU."""
    import torch  # noqa: F401 - the pack's modules need it imported
    comfy_env.require_comfyui()
    pack = comfy_env.load_pack()
    blocks = importlib.import_module(pack.__name__ + ".benchmarks.family_blocks")
    blocks.CASES["flux-tiny"] = blocks.Case("flux-tiny", "a tiny Flux double block",
                                            blocks.flux_case("double", 1024, 16, width=512, heads=4))
    out = tmp_path / "ab.json"
    try:
        assert blocks.main(["--cases", "flux-tiny", "--device", "cpu", "--repeats", "1", "--split-floor-tokens", "0",
                            "--fast-paths-ab", "--fast-paths", "none,-kept_launches", "--ab-rounds", "2",
                            "--json", str(out)]) == 0
    finally:
        blocks.CASES.pop("flux-tiny")
    result = json.loads(out.read_text())["fast_paths_ab"][0]
    assert [row["variant"] for row in result["rows"]] == ["all on", "none", "-kept_launches"]
    assert all(row["rounds"] == 2 and row["ms"] > 0 for row in result["rows"]) and result["stock_ms"] > 0
    assert result["rows"][0]["vs_all_on"] == 1.0


def test_the_whole_model_benchmark_times_the_fast_paths_on_and_off(bench, narrow_wan, tmp_path):
    """`--whole-model --fast-paths-ab`: the pack's seconds a step with every fast path on and with none, in
    turns, on the first card and negative only (stock is not run)."""
    out = tmp_path / "records.jsonl"
    assert bench.main(["--formats", "bf16:16", "--layers", "1", "--frames", "5", "--size", "128x128",
                       "--steps", "1", "--fast-paths-ab", "--ab-rounds", "1", "--json", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 1 and records[0]["negative"] == "zeros"
    assert [row["variant"] for row in records[0]["fast_paths_ab"]] == ["all on", "none"]
