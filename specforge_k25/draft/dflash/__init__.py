"""DFlash: block drafting from K target states (served as SGLang/vLLM `DFlashDraftModel`)."""
