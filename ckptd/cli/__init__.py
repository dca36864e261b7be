"""Command-line tools: ckptctl (ckptctl.py, its commands in ctl/), `ckptd serve` and
`ckptd agent`."""
