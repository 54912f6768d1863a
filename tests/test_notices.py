"""Typed notices (qkv_core/notices.py): each fallback, passed-over backend or skipped module is a `Notice` with a
kind, a subject and a reason; its text is the log line users read, and the run report counts from the fields,
never from the text."""
from __future__ import annotations

import importlib
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from support import comfy_env
import qkv_core as qc
from qkv_core import notices

pytestmark = pytest.mark.comfyui

# What nodes/report.py matched before notices had kinds: a line it took for a module on ComfyUI's forward
OLD_RAN_STOCK = re.compile(r"^\[QKV\] (?P<what>.+?) runs as ComfyUI's own: (?P<reason>.*)$", re.DOTALL)


def _pack():
    """The pack as ComfyUI loads it (its own copy of qkv_core: its `Notice`s are the ones the nodes read)."""
    comfy_env.require_comfyui()
    pack = comfy_env.load_pack()
    modules = {"core": "qkv_core", "compat": "nodes.compat", "report": "nodes.report", "patching": "nodes.patching"}
    out = SimpleNamespace(**{key: importlib.import_module(f"{pack.__name__}.{name}") for key, name in modules.items()})
    out.core.reset_notices()
    out.notice = lambda kind, subject, reason, text: out.core.Notice(kind, subject, reason, text)
    return out


def _lookalike(pack):
    """A notice of another kind whose text reads like a fallback (a backend's reason may quote anything)."""
    return pack.notice(notices.PASSED_OVER, "flash", "a reason quoting a log line",
                       "[QKV] Wan block runs as ComfyUI's own: quoted in a backend's reason")


# --- the notice itself -------------------------------------------------------------------------------------
def test_a_notice_carries_its_fields_and_its_text_is_the_log_line(caplog):
    caplog.set_level(logging.INFO, logger="qkv_core")
    notice = notices.Notice(notices.UNSPLIT, "the q projection", "block-scaled", "[Attention] a line as logged")
    assert (notice.kind, notice.subject, notice.reason, str(notice)) == \
        (notices.UNSPLIT, "the q projection", "block-scaled", "[Attention] a line as logged")
    assert notices.notice_once("test:unsplit", notice) and not notices.notice_once("test:unsplit", notice)
    [record] = caplog.records
    assert record.getMessage() == "[Attention] a line as logged" and record.notice is notice
    assert qc.drain_notices() == [notice] and qc.drain_notices() == []
    with pytest.raises(ValueError, match="unknown notice kind"):
        notices.Notice("odd", "x", "y", "z")
    with pytest.raises(TypeError, match="takes a Notice"):
        notices.notice_once("test:text", "[QKV] a bare line")
    with pytest.raises(AttributeError):   # frozen: what was logged is what the report reads
        notice.kind = notices.FALLBACK


def test_a_passed_over_backend_is_a_notice_of_its_kind():
    """A forced backend that cannot run here (flash on the CPU): kind, the backend as subject, its reason."""
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    qc.pay_attention(q, k, v, force_attention="flash")
    [notice] = qc.drain_notices()
    assert (notice.kind, notice.subject) == (notices.PASSED_OVER, "flash") and not notice.by_design
    assert str(notice) == f"[Attention] flash backend not used: {notice.reason}; falling back to the next one"


@pytest.mark.comfyui
def test_a_fallback_and_a_short_call_are_notices_of_their_kinds():
    """`compat.guarded` refusing a call: a fallback (kind, the module as subject, the reason) or, for a
    family's short sequences, a short call (by design); each text as the log has always said it."""
    pack = _pack()
    compat = pack.compat

    def installed(reason):
        return compat.guarded("Wan block", lambda x: x, lambda x: -x, refuse=lambda args, kwargs: reason,
                              check=lambda args, kwargs: None)
    x = torch.ones(2)
    with torch.no_grad():
        assert torch.equal(installed("a planted reason")(x), x)
        assert torch.equal(installed(compat.ShortCall("12 tokens, under the split floor"))(x), x)
    fallback, short = pack.core.drain_notices()
    assert (fallback.kind, fallback.subject, fallback.reason) == (notices.FALLBACK, "Wan block", "a planted reason")
    assert str(fallback) == "[QKV] Wan block runs as ComfyUI's own: a planted reason"
    assert (short.kind, short.subject, short.reason) == \
        (notices.SHORT_CALL, "Wan block", "12 tokens, under the split floor") and short.by_design
    assert str(short) == f"[QKV] Wan block: {compat.SHORT_CALL_NOTICE} (12 tokens, under the split floor)"


@pytest.mark.comfyui
def test_a_skipped_module_is_a_notice_of_its_kind():
    report = _pack().report.PatchReport()
    report.skipped("Wan", "diffusion_model.blocks.0", "another node patched it")
    report.skipped("Wan", "diffusion_model.blocks.1", "another node patched it")
    first = report.skips[0]
    assert (first.kind, first.family, first.subject, first.reason) == \
        (notices.SKIPPED, "Wan", "diffusion_model.blocks.0", "another node patched it")
    assert str(first) == "Wan: diffusion_model.blocks.0 runs as before: another node patched it"
    assert report.skipped_reasons == {("Wan", "another node patched it"): ["diffusion_model.blocks.0",
                                                                           "diffusion_model.blocks.1"]}
    assert report.lines() == ["Wan: diffusion_model.blocks.0 and 1 more runs as before: another node patched it"]


# --- the report reads the fields -----------------------------------------------------------------------------
def _finished(pack, planted):
    run = pack.report.RunReport("Wan", "High, block bounds, backend sdpa", pack.report.PatchReport())
    patcher = SimpleNamespace(get_wrappers=lambda kind, key: [])   # no reference cache
    pack.patching.finish_report(run, patcher, None, None, None, None, False, planted)
    return run


@pytest.mark.comfyui
def test_the_report_counts_fallbacks_by_kind_not_by_text():
    """A notice of another kind whose text reads like a fallback is listed, but is no module on ComfyUI's
    forward: the saving stays full (the old text match took it for one); a fallback counts by its kind."""
    pack = _pack()
    lookalike = _lookalike(pack)
    assert OLD_RAN_STOCK.match(str(lookalike))   # the text parsing would have counted it
    run = _finished(pack, [lookalike])
    assert run.fallbacks == [lookalike] and run.ran_stock == [] and run.saving == "full"
    assert run.headline() is None
    fallback = pack.notice(notices.FALLBACK, "Wan block", "the outputs differ",
                           "[QKV] Wan block runs as ComfyUI's own: the outputs differ")
    chosen = pack.notice(notices.AUTO_CHOICE, "sage", "calls under 4096 tokens",
                         "[Attention] auto: sage is not used for calls under 4096 tokens")
    run = _finished(pack, [lookalike, chosen, fallback, fallback])
    assert run.fallbacks == [lookalike, fallback, fallback] and run.notes == [chosen]
    assert run.ran_stock == [("Wan block", "the outputs differ")] and run.saving == "none"
    assert run.headline() == "No saving this run: Wan block ran as ComfyUI's own (the outputs differ)"
    payload = run.as_payload()
    assert payload["fallbacks"] == [str(lookalike), str(fallback), str(fallback)]
    assert payload["notes"] == [str(chosen)]
    assert payload["ran_stock"] == [{"what": "Wan block", "reason": "the outputs differ"}]
    assert {"kind": notices.FALLBACK, "subject": "Wan block", "reason": "the outputs differ"} in payload["notices"]


@pytest.mark.comfyui
def test_the_estimate_goes_back_on_a_fallback_only():
    """Mid-run, ComfyUI's estimate is put back when a module ran its own forward, and not for a notice of
    another kind that only reads like one."""
    pack = _pack()
    failed = pack.notice(notices.FALLBACK, "Wan block", "a check failed",
                         "[QKV] Wan block runs as ComfyUI's own: a check failed")
    for planted, restored in ((_lookalike(pack), False), (failed, True)):
        run = pack.report.RunReport("Wan", "High", pack.report.PatchReport())
        model = SimpleNamespace(memory_usage_factor=0.5)
        active = pack.patching._ActiveRun(run, model, 1.0, 0.5)
        pack.core.notices.notice_once(f"test:{restored}", planted)
        active.watch()
        assert active.notices == [planted]
        assert (run.estimate_restored, model.memory_usage_factor) == ((True, 1.0) if restored else (False, 0.5))
