"""Acceptance length of exported draft heads (any draft method), measured by SGLang's own speculative decoding."""
