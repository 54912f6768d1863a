"""Helpers the tests share (not test modules): imported as `from support import comfy_env` (tests/ is on sys.path)."""
