"""Hooks into other libraries. ``gdn.integrations.transformers``: run Hugging Face Qwen3-Next / Qwen3.5 GDN layers on
gdn (imports transformers only when that submodule is imported)."""
