"""The EAGLE-3 draft: model, draft vocabulary, TTT loss."""
