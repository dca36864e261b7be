"""Command-line tools: ckptctl (and, later, ckptd serve)."""
