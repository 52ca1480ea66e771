"""Turning outcomes into what people read after a run: `report.json` and `summary.md` (`report`), conformance
levels and the badge (`levels`), one report from a campaign's shards (`merge`), expected failures (`expected`),
the run's first screen and usage errors (`usage`), the checks as the docs show them (`checks_page`), and
generated Markdown sections (`readme`)."""
