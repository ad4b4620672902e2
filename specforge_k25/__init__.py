"""specforge_k25: online EAGLE-3 draft training for Kimi-K2.5 with the target inside SGLang."""
__version__ = "0.1.0"
