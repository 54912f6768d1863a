"""Test helper: node packs loaded the way ComfyUI loads them (`nodes.load_custom_node`) and prompts run through
ComfyUI's own `execution.PromptExecutor` with a stand-in server (no web server); ComfyUI set up by `comfy_env`.
Reachable as ``comfy_env.run_prompt`` and so on, as the tests call them."""
from __future__ import annotations

import asyncio
import inspect
import uuid
from pathlib import Path



def setup():
    """ComfyUI set up (`comfy_env.setup`), imported when first needed (see `tiny_wan.setup`)."""
    from support import comfy_env
    comfy_env.setup()

def load_custom_node(path, ignore=()):
    """Register a custom node folder (or file) through ComfyUI's own ``nodes.load_custom_node``.

    Returns ComfyUI's bool (False when the pack failed to import; ComfyUI only logs the error)."""
    setup()
    import nodes
    fn = nodes.load_custom_node
    res = fn(str(path), ignore=set(ignore))
    if inspect.isawaitable(res):
        res = asyncio.run(res)
    return res


class StubServer:
    """The part of ``server.PromptServer`` that ``execution.PromptExecutor`` uses; records messages."""

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.messages = []

    def send_sync(self, event, data, sid=None):
        self.messages.append((event, data))

    def send_progress_text(self, text, node_id, sid=None):
        self.messages.append(("progress_text", {"text": text, "node": node_id}))

    def queue_updated(self):
        pass


def make_executor(server=None):
    """``execution.PromptExecutor`` with a stub server and the classic cache (v0.8.0 and v0.33 take
    ``cache_args``, v0.3.64 ``cache_size``; v0.33 also reads ``cache_args["ram_inactive"]``, which v0.8.0
    ignores)."""
    setup()
    import execution
    server = server or StubServer()
    params = inspect.signature(execution.PromptExecutor.__init__).parameters
    if "cache_args" in params:
        return execution.PromptExecutor(server, cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
    return execution.PromptExecutor(server, cache_type=execution.CacheType.CLASSIC, cache_size=0)


def run_prompt(prompt, executor=None, prompt_id=None, extra_data=None):
    """Validate and execute an API-format prompt with ComfyUI's own engine, no web server.

    Returns the executor; check ``executor.success``, ``executor.history_result["outputs"]`` (ui outputs per
    node id), ``executor.status_messages`` and ``executor.server.messages``. Raises ``AssertionError`` with
    ComfyUI's messages if validation fails. Pass the same executor again to exercise its output cache."""
    setup()
    import execution
    executor = executor or make_executor()
    prompt_id = prompt_id or str(uuid.uuid4())
    valid = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
    ok, error, outputs, node_errors = valid[0], valid[1], valid[2], valid[3]
    if not ok:
        raise AssertionError(f"prompt failed validation: {error} {node_errors}")
    executor.execute(prompt, prompt_id, extra_data or {}, outputs)
    return executor


def execution_error(executor):
    """The ``execution_error`` message of a failed run (dict), or None."""
    for event, data in executor.status_messages:
        if event == "execution_error":
            return data
    return None
