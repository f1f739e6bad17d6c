"""Query-outer sparse attention for decode rows (``attention``: torch path and oracle;
``attention_triton``: the split kernel)."""
