"""The draft methods: the contract every method meets (method.py), the registry that checks it
(registry.py), the `draft.*` fields all share (spec.py), and what their models build from (layers,
vocabulary, objective counters, export folder); one folder per method (docs/NEW_METHOD.md)."""
