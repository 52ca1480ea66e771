"""Commands beside the pytest plugin: `python -m conformance init` (`init`) and `python -m conformance soak`
(`soak`)."""
