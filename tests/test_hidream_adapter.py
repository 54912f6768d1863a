"""The HiDream-I1 adapter (`nodes/families/hidream.py`) against a real ComfyUI, on a tiny random-weight HiDream built from
ComfyUI's own config class (the split floor lowered to 0 so that a few hundred tokens split): every attention and
block is patched and the model equals stock at every level, in float32 and bf16; the pack's mixture of experts
equals ComfyUI's module (float32 within 1e-6, bf16 but near a routing tie: none differ on the CPU) and one it does
not know runs the module; the bounded block's peak (CPU MemTracker) and its rerouted tokens; the routed
self-check's tolerance; what the pack does not take runs ComfyUI's own with a log line: a RoPE that covers only
part of each head (other configurations), a per-token key multiplier (`image_tokens_masks`), another node's
`attn1_patch`, a processor another node put in. (The contract test runs the split at real sizes, a 2-step sample
and a LoRA: tests/test_family_contract.py.) Skipped without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support import working_set_check
from support import family_cases
from support.comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

HEADS = 4


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


@pytest.fixture(scope="module")
def hidream(env):
    return importlib.import_module(env.pack.__name__ + ".nodes.families.hidream")


@pytest.fixture(scope="module")
def hidream_moe(env):
    return importlib.import_module(env.pack.__name__ + ".nodes.families.hidream_moe")


def hidream_model(**config):
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    if not hasattr(comfy.supported_models, "HiDream"):
        pytest.skip("this ComfyUI has no HiDream")
    model_config = comfy.supported_models.HiDream({**family_cases.HIDREAM, **config})
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def hidream_inputs(torch, batch=1, side=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(batch, 16, side, side, generator=g), t=torch.tensor([0.5] * batch),
                y=torch.randn(batch, 32, generator=g), context=torch.randn(batch, 12, 32, generator=g),
                encoder_hidden_states_llama3=torch.randn(batch, 2, 8, 32, generator=g))


def patched_counts(report) -> dict:
    return {what: n for (family, what), n in report.patched_counts.items()}


def test_every_attention_equals_stock_at_every_level(env, hidream, split_everything):
    torch = env.torch
    base = hidream_model()
    inputs = hidream_inputs(torch, batch=2)
    reference = forward(base, inputs)
    for level in env.node.LEVELS:
        for bounds in (False, True):
            patched, report = env.node.apply_patch(base, level, "sdpa", bounds)
            assert patched_counts(report) == ({"attention": 2, "block": 2} if bounds else {"attention": 2})
            assert not report.skipped_reasons, report.lines()
            env.core.reset_notices()
            with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
                out = forward(base, inputs, applied=patched)
            assert not stock_fallbacks(env), (level, bounds)
            assert rel_err(out, reference) <= 1e-5, (level, bounds, rel_err(out, reference))
            policy = env.core.SplitPolicy(env.node.LEVELS.index(level), 0,
                                          group_scale=hidream.SPEC.measured.group_scale)
            groups = policy.plan(HEADS, 10**6).groups
            assert HEADS // groups in spy.self_heads, (level, spy.self_heads)   # the split really ran
    assert torch.equal(forward(base, inputs), reference)


def test_partial_rope_runs_stock(env, split_everything):
    """A configuration whose RoPE covers half of each head (ComfyUI rotates the first channels only): every
    attention runs ComfyUI's own, with the reason in the log, and the output is stock's."""
    torch = env.torch
    base = hidream_model(axes_dims_rope=[8, 4, 4])   # 16 of the head's 32 channels
    inputs = hidream_inputs(torch)
    reference = forward(base, inputs)
    patched, report = env.node.apply_patch(base, "High", "sdpa", False)
    assert patched_counts(report) == {"attention": 2}
    env.core.reset_notices()
    out = forward(base, inputs, applied=patched)
    fallbacks = stock_fallbacks(env)
    assert fallbacks and all("partial RoPE" in line for line in fallbacks), fallbacks
    assert torch.equal(out, reference)


def test_key_multiplier_and_hooks_run_stock(env, hidream, split_everything):
    """`image_tokens_masks` (a per-token key multiplier ComfyUI's model never passes) and another node's
    `attn1_patch` make the attention run ComfyUI's own: the same numbers, a log line each."""
    torch = env.torch
    base = hidream_model()
    attn = base.model.diffusion_model.double_stream_blocks[0].block.attn1
    ours = hidream.attention_forward(attn, env.node.QKVConfig(3, "sdpa", False))
    g = torch.Generator().manual_seed(5)
    img, txt = torch.randn(1, 64, 128, generator=g), torch.randn(1, 28, 128, generator=g)
    rope = base.model.diffusion_model.pe_embedder(torch.zeros(1, 92, 3))
    mask = (torch.rand(1, 64, generator=g) > 0.3).float()
    with torch.no_grad():
        stock = attn(img, mask, txt, rope=rope)
        env.core.reset_notices()
        out = ours(img, mask, txt, rope=rope)
    assert any("image_tokens_masks" in line for line in stock_fallbacks(env))
    assert all(torch.equal(a, b) for a, b in zip(out, stock))

    def hook(q, k, v, pe=None, attn_mask=None, extra_options=None):
        return {"q": q * 1.5}
    options = {"patches": {"attn1_patch": [hook]}}
    with torch.no_grad():
        env.core.reset_notices()
        ours(img, None, txt, rope=rope, transformer_options=options)
    assert any("attn1_patch" in line for line in stock_fallbacks(env))


def test_a_foreign_processor_is_not_patched(env):
    """Another node's attention processor: that module keeps its forward (one report line)."""
    base = hidream_model()
    attn = base.model.diffusion_model.single_stream_blocks[0].block.attn1

    class Other:
        def __call__(self, attn, *args, **kwargs):
            return kwargs["image_tokens"]
    attn.processor = Other()
    patched, report = env.node.apply_patch(base, "High", "sdpa", False)
    assert patched_counts(report) == {"attention": 1}
    assert any("single_stream_blocks.0.block.attn1 runs as before: its processor is Other" in line
               for line in report.lines())


def test_bounded_block_peak():
    """A HiDream double block (bf16, CPU MemTracker, 12,288 image + 256 text tokens, 16 heads): the bounded block's
    peak (its mixture of experts computed by the pack: a token chunk's routed sum and an expert's row chunk beside
    the output) against stock's, under 2.5 |x|; outputs equal stock's but for tokens routed to other experts by
    round-off (counted: their error is far above the median token's)."""
    comfy_env.require_comfyui()
    import torch
    import comfy.ldm.hidream.model as hidream_model
    import comfy.ops
    pack = comfy_env.load_pack()
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    hidream = importlib.import_module(pack.__name__ + ".nodes.families.hidream")
    compat = importlib.import_module(pack.__name__ + ".nodes.compat")
    from support.working_set_check import measurement_module
    memory = measurement_module(pack)
    width, heads, side, text = 512, 16, 96, 256
    block = hidream_model.HiDreamImageTransformerBlock(width, heads, width // heads, 4, 2, dtype=torch.bfloat16,
                                                       device=torch.device("cpu"),
                                                       operations=comfy.ops.disable_weight_init)
    comfy_env.fill_random_(block, seed=0)
    block.eval()
    g = torch.Generator().manual_seed(1)
    tokens = side * 128
    ids = torch.zeros(1, tokens + text, 3)
    ids[0, :tokens, 1] = (torch.arange(tokens) // 128).float()
    ids[0, :tokens, 2] = (torch.arange(tokens) % 128).float()
    inp = dict(image_tokens=torch.randn(1, tokens, width, generator=g).to(torch.bfloat16), image_tokens_masks=None,
               text_tokens=torch.randn(1, text, width, generator=g).to(torch.bfloat16),
               adaln_input=torch.randn(1, width, generator=g).to(torch.bfloat16),
               rope=hidream_model.EmbedND(theta=10000, axes_dim=[16, 8, 8])(ids))
    x_bytes = inp["image_tokens"].numel() * inp["image_tokens"].element_size()
    live = [block, list(inp.values())]
    bounded_forward = hidream.block_forward(block, hidream.SPEC.configure(node.QKVConfig(3, "sdpa", True)))
    pack.qkv_core.reset_notices()
    with torch.no_grad():
        working_set_check.check_first_call(pack, bounded_forward, **inp)   # outside the measurement
        assert not comfy_env.lines_of_kind(pack.qkv_core.drain_notices(), pack.qkv_core.notices.FALLBACK)
        stock = memory.measure_peak(block, **inp, live=live)
        bounded = memory.measure_peak(bounded_forward, **inp, live=live)
        gaps = []   # per token: the gate's score of its k-th expert less the next one's (stock's run, float32)
        gate = block.ff_i.gate
        record = gate.register_forward_pre_hook(lambda _module, args: gaps.append(
            torch.nn.functional.linear(args[0].reshape(-1, width).float(), gate.weight.float()).softmax(-1)
            .sort(dim=-1, descending=True).values[:, gate.top_k - 1:gate.top_k + 1].diff(dim=-1).neg().flatten()))
        try:
            block(**inp)
        finally:
            record.remove()
    ratio_stock, ratio_bounded = stock.peak_bytes / x_bytes, bounded.peak_bytes / x_bytes
    working_set_check.assert_estimates(pack, hidream, "block", heads, tokens + text, ratio_stock, ratio_bounded)
    print(f"\nHiDream double block bf16 {tokens} + {text} tokens x {width}, {heads} heads: stock {ratio_stock:.2f}x|x|, "
          f"bounded {ratio_bounded:.2f}x|x| ({bounded.peak_bytes / stock.peak_bytes:.2f} of stock)")
    assert ratio_bounded <= 2.5   # the split attention's peak; the mixture of experts' is under it
    assert bounded.peak_bytes <= 0.2 * stock.peak_bytes
    base = (inp["image_tokens"], inp["text_tokens"])
    assert compat.compare(stock.result, bounded.result, base, routed=True) is None
    # a token whose error is far above the others' took another expert: round-off moved it across a routing tie, so
    # it is one of the few whose gate scores its k-th and next expert nearly alike (the 1 % smallest gaps, from
    # stock's run). Every other token differs by round-off, at most two bf16 steps (2 x 2^-7) of the output's largest
    # value (measured: 0-1 of 12,288 tokens rerouted, the others within 7.9e-3 to 1.05e-2 as the CPU's kernels round;
    # 5.2e-3 where the experts' inputs took the block's three roundings: `hidream_moe.ModulatedNorm` rounds once).
    gap = torch.cat(gaps)
    near_tie = gap <= gap.quantile(0.01)
    ours, theirs = bounded.result[0].float(), stock.result[0].float()
    error = (ours - theirs).norm(dim=-1).flatten()
    rerouted = error > 10 * error[error > 0].median()
    rest = float((ours - theirs).flatten(0, -2)[~near_tie].abs().max() / theirs.abs().max())
    print(f"rerouted (error > 10 x the median nonzero token error): {int(rerouted.sum())} of {error.numel()} "
          f"tokens, all near a routing tie: {bool(near_tie[rerouted].all())}; the other tokens' max difference "
          f"{rest:.2e} of the output's largest value")
    assert bool(near_tie[rerouted].all())
    assert float(rerouted.float().mean()) <= 0.01 and rest <= 2 * 2 ** -7


def moe_setup(torch, dtype, batch=2, tokens=1536, width=256, top_k=2, weights=None, manual_cast=False, seed=0):
    """ComfyUI's `MOEFeedForwardSwiGLU` (4 experts, random weights; `weights`: their dtype, cast at each call by
    ComfyUI's manual-cast layers where `manual_cast`), the double block's LayerNorm, and a stream with its
    modulation (one vector per batch item)."""
    import comfy.ldm.hidream.model as hidream_model
    import comfy.ops
    ops = comfy.ops.manual_cast if manual_cast else comfy.ops.disable_weight_init
    ff = hidream_model.MOEFeedForwardSwiGLU(width, 4 * width, 4, top_k, dtype=weights or dtype,
                                            device=torch.device("cpu"), operations=ops)
    comfy_env.fill_random_(ff, seed=seed)
    with torch.no_grad():   # a router with some spread: every expert takes tokens, a few sit near a tie
        ff.gate.weight.normal_(0, 3 / width ** 0.5, generator=torch.Generator().manual_seed(seed))
    norm = ops.LayerNorm(width, eps=1e-06, elementwise_affine=False)
    g = torch.Generator().manual_seed(seed + 1)
    out = torch.randn(batch, tokens, width, generator=g).to(dtype)
    shift, scale = ((0.3 * torch.randn(batch, 1, width, generator=g)).to(dtype) for _ in range(2))
    return ff, norm, out, shift, scale


# A routing tie, in bf16: scores (~0.25 each of 4 experts) within a few of their roundings (2^-10 .. 2^-9) apart,
# which a rounding of the logits (~2^-7 of a logit of ~1) can swap
TIE = 2.0 ** -8


def routing_gaps(torch, ff, x):
    """Each token's margin between its last chosen expert's score and the best one left out (float32 of the
    gate's scores in x's dtype): round-off flips a choice only where this is tiny."""
    with torch.no_grad():
        scores = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), ff.gate.weight.to(x.dtype)).softmax(-1)
    top = scores.float().topk(ff.gate.top_k + 1, dim=-1).values
    return top[:, -2] - top[:, -1]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_bounded_moe_equals_comfyuis_module(env, hidream_moe, dtype_name):
    """The pack's mixture of experts (`hidream_moe.bounded_moe_`: routing once, experts on their rows by chunks, the routed
    sum by token chunks) against ComfyUI's `MOEFeedForwardSwiGLU` on the same modulated input: float32 within
    1e-6; bf16 within its round-off (2 % of a token's norm) on every token but those near a routing tie. Weights as stored and cast per call; 2 batch items with their
    own modulation, and one shared by both; top-1 and top-2; a budget small enough to split an expert's rows."""
    torch = env.torch
    dtype = getattr(torch, dtype_name)
    cases = [dict(), dict(manual_cast=True, weights=torch.float16), dict(top_k=1), dict(budget=0.05, batch=3),
             dict(shared_modulation=True)]
    for case in cases:
        case = dict(case)
        budget, shared_modulation = case.pop("budget", None), case.pop("shared_modulation", False)
        ff, norm, out, shift, scale = moe_setup(torch, dtype, **case)
        if shared_modulation:
            shift, scale = shift[:1], scale[:1]
        assert hidream_moe.bounded_moe_refusal(ff, out, norm, (shift, scale, shift)) is None
        with torch.no_grad():
            x = norm(out).to(dtype) * (1 + scale) + shift
            stock = ff(x)
            ours = torch.full_like(stock, float("nan"))

            def keep(part, y, a, b):
                ours[:, a:b] = y
            saved = hidream_moe.MOE_BUDGET
            hidream_moe.MOE_BUDGET = budget or saved
            try:
                hidream_moe.bounded_moe_(out, norm, ff, shift, scale, 1, keep)
            finally:
                hidream_moe.MOE_BUDGET = saved
        # a token differs when it is off by more than bf16 round-off (products over another count of rows may round
        # their sums otherwise: oneDNN blocks some CPUs' bf16 matmuls by the row count); one sent to another expert
        # is off by an expert's output
        error = (ours.double() - stock.double()).norm(dim=-1) / stock.double().norm(dim=-1).clamp_min(1e-30)
        differs = (error > 2e-2).reshape(-1)
        if dtype == torch.float32:
            assert rel_err(ours, stock) <= 1e-6, (case, rel_err(ours, stock))
        else:
            near = routing_gaps(torch, ff, x) <= TIE   # tokens a rounding of the logits may send elsewhere
            print(f"\n{case}: {int(differs.sum())} of {differs.numel()} tokens differ, "
                  f"{int(near.sum())} within {TIE:.2g} of a routing tie")
            assert not bool((differs & ~near).any()), case   # only a token near a tie may differ
            assert float(differs.float().mean()) <= 0.01, case


def test_unknown_mixtures_run_comfyuis_module(env, hidream_moe, split_everything):
    """What the bounded mixture does not know runs as ComfyUI's own module on token chunks, with the same
    numbers: normalized top-k weights (`norm_topk_prob`), another scoring function, an expert of another class,
    a layer class the pack does not know, modulation of another dtype. A model whose experts are of another
    class equals stock's, every block still bounded."""
    torch = env.torch
    ff, norm, out, shift, scale = moe_setup(torch, torch.float32)
    mods = (shift, scale, shift)
    assert hidream_moe.bounded_moe_refusal(ff, out, norm, mods) is None
    ff.gate.norm_topk_prob = True
    assert "norm_topk_prob" in hidream_moe.bounded_moe_refusal(ff, out, norm, mods)
    ff.gate.norm_topk_prob = False
    ff.gate.scoring_func = "sigmoid"
    assert "scoring function" in hidream_moe.bounded_moe_refusal(ff, out, norm, mods)
    ff.gate.scoring_func = "softmax"
    assert "modulation" in hidream_moe.bounded_moe_refusal(ff, out, norm, (shift.double(), scale, shift))

    class OtherExpert(type(ff.experts[1])):
        def forward(self, x):
            return super().forward(x)
    original = ff.experts[1]
    ff.experts[1].__class__ = OtherExpert
    assert "OtherExpert" in hidream_moe.bounded_moe_refusal(ff, out, norm, mods)
    ff.experts[1].__class__ = type(ff.experts[0])

    class OtherLinear(torch.nn.Linear):   # a layer that computes its own way
        def forward(self, x):
            return super().forward(x)
    layer = OtherLinear(256, original.w1.weight.shape[0], bias=False)
    ff.experts[1].w1 = layer
    assert "experts.1.w1" in hidream_moe.bounded_moe_refusal(ff, out, norm, mods)

    base = hidream_model()
    inputs = hidream_inputs(torch)
    moes = [m for m in base.model.diffusion_model.modules() if hasattr(m, "shared_experts")]
    assert moes
    for moe in moes:
        moe.experts[0].__class__ = OtherExpert
        width = moe.gate.gating_dim
        vector = torch.zeros(1, 1, width)
        assert "OtherExpert" in hidream_moe.bounded_moe_refusal(moe, torch.zeros(1, 4, width), norm, (vector,) * 3)
    reference = forward(base, inputs)
    patched, report = env.node.apply_patch(base, "High", "sdpa", True)
    assert patched_counts(report) == {"attention": 2, "block": 2}
    env.core.reset_notices()
    result = forward(base, inputs, applied=patched)
    assert not stock_fallbacks(env)
    assert rel_err(result, reference) <= 1e-5


def test_routed_check_leaves_out_a_few_rerouted_tokens(env):
    """`compat.compare(routed=True)`: a token or two of 256 with another expert's output pass, 5% of them do not."""
    torch = env.torch
    compat = importlib.import_module(env.pack.__name__ + ".nodes.compat")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 256, 64, generator=g)
    stock = base + torch.randn(1, 256, 64, generator=g)
    ours = stock + 1e-6 * torch.randn(1, 256, 64, generator=g)
    rerouted = ours.clone()
    rerouted[0, 7] += torch.randn(64, generator=g)    # one token took another expert
    assert compat.compare(stock, rerouted, base) is not None
    assert compat.compare(stock, rerouted, base, routed=True) is None
    many = ours.clone()
    many[0, :13] += torch.randn(13, 64, generator=g)  # 5%: not round-off
    assert compat.compare(stock, many, base, routed=True) is not None
