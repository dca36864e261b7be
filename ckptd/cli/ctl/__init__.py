"""ckptctl's parts: one module per command (cmd_*.py) over what they share (output.py: exit
codes, text and the JSON document; progress.py: the bars; connection.py: the coordinator
options and client). ckptd.cli.ckptctl holds the parser and `main`, the one place that
turns errors into exit codes; the commands never import each other (pyproject.toml's
import-linter contracts check both)."""
