"""How fast the suite is, measured side by side in one run: `python -m conformance.bench` (`measure`), the targets
it is held to and the table of a result against them (`targets`), and the warm trial of this checkout against an
older one (`ab`), and what the state digests cost (`digests`)."""
