"""Subcommands of the ``pagedserve`` CLI (see ``pagedserve.cli``)."""
