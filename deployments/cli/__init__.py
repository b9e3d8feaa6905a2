"""The ``bcg`` command (``pyproject.toml``: ``bcg = "deployments.cli.main:main"``; ``python -m deployments.cli.main``)
and the modules only it uses: the argument parser and subcommands (:mod:`~deployments.cli.main`), the verify, warm
and profile tables (:mod:`~deployments.cli.commands`), ``bcg plan`` (:mod:`~deployments.cli.plan_command`), ``bcg
serve`` (:mod:`~deployments.cli.serve_command`), the local server (:mod:`~deployments.cli.local`), what ``bcg serve``
prints (:mod:`~deployments.cli.console`), and the demo replay (:mod:`~deployments.cli.demo`,
:mod:`~deployments.cli.demo_replay`, :mod:`~deployments.cli.demo_report`, :mod:`~deployments.cli.retry_client`).

Nothing is re-exported: importing this package starts nothing and imports nothing; import the module you need.
"""

__all__: list[str] = []
