"""``python -m fp8_plugin``: the ``fp8-plugin devices`` command.

Which FP8 recipes run their GEMMs natively on this machine (the CPU and every CUDA device), what
recipe "auto" becomes, and on the CPU the GEMM path of each operand pairing: the paths training
takes here. ``--json`` prints one JSON object; ``--help`` prints the usage.
"""

import typer

from .tools.cli import devices
from .tools.quiet import quiet_foreign_output


def main() -> None:
    """Run :func:`fp8_plugin.tools.cli.devices` as a command of its own."""
    quiet_foreign_output()
    app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)
    app.command()(devices)
    app(prog_name="python -m fp8_plugin")


if __name__ == "__main__":
    main()
