"""Acceptance length of an exported EAGLE-3 head, measured by SGLang's own speculative decoding."""
